"""``molt compare``: two arms of runs on one metric (molt.commands.stats.compare)."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("compare")
@click.argument("a")
@click.argument("b")
@click.option("--metric", required=True,
              help="a results: name (e.g. accuracy_final) or a metric key")
@click.option("--margin", type=float, help="equivalence margin, in the metric's unit (e.g. 0.05)")
@click.option("--confidence", type=float, default=0.95, help="of the intervals; tests at 1 - this")
@click.option("--json", "json_path", help="also write the comparison to this JSON file")
def command(a: str, b: str, metric: str, margin: float | None, confidence: float,
            json_path: str | None) -> int:
    """Compare two sweeps (or run lists) on one metric.

    Prints the difference, its intervals, p-values and a verdict. A and B: a sweep folder, run
    folders joined by commas, or a JSON file of runs.
    """
    from molt.commands.stats import compare
    from molt.commands.sweep import arm_values

    runs_a, runs_b = arm_values(a, metric), arm_values(b, metric)
    result = compare(list(runs_a.values()), list(runs_b.values()), metric, margin, confidence)
    for label, arm, runs in (("A", a, runs_a), ("B", b, runs_b)):
        click.echo(f"{label} = {arm}" + ("" if "," in arm else f" ({', '.join(runs)})"))
    click.echo(result.describe())
    if json_path:
        Path(json_path).write_text(json.dumps(result.to_dict(), indent=1))
    return 0
