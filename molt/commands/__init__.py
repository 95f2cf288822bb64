"""The `molt` command line: one module per command."""
