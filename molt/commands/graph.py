"""``molt graph``: a pipeline's validated DAG."""

from __future__ import annotations

import click
import yaml

from molt.commands.run import SET, load_pipeline


@click.command("graph")
@click.argument("pipeline", type=click.Path())
@click.option("--resolved", is_flag=True, help="print the pipeline as it loads: its base merged, "
              "the policy: block's facts stated once (a run's pipeline.yaml)")
@SET
def command(pipeline: str, resolved: bool, overrides: tuple[str, ...]) -> int:
    """Print a pipeline's validated DAG: stages, edges, columns."""
    pipe = load_pipeline(pipeline, list(overrides))
    click.echo(yaml.safe_dump(pipe.to_dict(), sort_keys=False) if resolved else pipe.describe())
    return 0
