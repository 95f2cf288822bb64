"""The ``molt`` command: one click group, one command per module of this package."""

from __future__ import annotations

import os
import sys
from typing import Any

import click

from molt.commands import compare, export, graph, models, plot, replay, run, sweep
from molt.commands import eval as eval_
from molt.commands import inspect as inspect_


class Molt(click.Group):
    """Exits with the command's code; a ValueError 2 as ``molt: error: ...``, Ctrl-C 130."""

    def invoke(self, ctx: click.Context) -> Any:
        try:
            code = super().invoke(ctx)
        except ValueError as e:
            click.echo(f"molt: error: {e}", err=True)
            code = 2
        except KeyboardInterrupt:
            click.echo("molt: interrupted", err=True)
            code = 130
        ctx.exit(code)


@click.group(cls=Molt, context_settings={"help_option_names": ["-h", "--help"],
                                         "show_default": True})
def main() -> None:
    """Asynchronous RL of language models as a DAG of stages.

    \b
    Shell completion (bash; zsh_source, fish_source for zsh, fish):
      eval "$(_MOLT_COMPLETE=bash_source molt)"
    """
    if os.getcwd() not in sys.path:  # custom stages and envs by import path from here, as in a run
        sys.path.insert(0, os.getcwd())


for _module in (run, sweep, compare, eval_, export, graph, replay, inspect_, plot, models):
    main.add_command(_module.command)
