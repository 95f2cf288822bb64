"""``python -m molt``: the ``molt`` command."""

from molt.commands import main

main(prog_name="molt")
