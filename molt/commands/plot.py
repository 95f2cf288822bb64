"""``molt plot``: PNG curves of a run's ``metrics.jsonl`` or of sweeps (matplotlib).

A run's figures, in ``RUN_DIR/plots/`` where the run has their metrics: reward, eval (accuracy
+- 1 s.e. per version), logprob_diff (trainer vs rollout), collapse, staleness, time (per stage),
expert_load (MoE). Sweeps' figures, in the first one's ``plots/``: ``sweep_{key}`` per curve of
``sweep.json`` (mean, 95% band, each seed faint) and ``sweep_threshold`` (time to threshold).
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click

from molt.commands.sweep import read_points

Series = dict[str, list[tuple[float, float]]]  # metric key -> [(step or NaN, value)]


@click.command("plot")
@click.argument("dirs", nargs=-1, required=True, type=click.Path(), metavar="RUN_DIR|SWEEP_DIR...")
def command(dirs: tuple[str, ...]) -> int:
    """Write PNG curves of a run, of a sweep, or of sweeps overlaid."""
    paths = [Path(d) for d in dirs]
    sweeps = (paths[0] / "sweep.json").is_file() or len(paths) > 1
    for path in plot_sweeps(paths) if sweeps else plot_run(paths[0]):
        click.echo(path)
    return 0


def _ending(series: Series, *suffixes: str) -> list[str]:
    return [k for suffix in suffixes for k in sorted(series) if k.endswith(suffix)]


def _save(figures: dict[str, Any], out: Path) -> list[Path]:
    out.mkdir(exist_ok=True)
    written = []
    for name, figure in figures.items():
        if figure is not None:
            written.append(out / f"{name}.png")
            figure.savefig(written[-1], dpi=100, bbox_inches="tight")
    return written


def plot_run(run_dir: Path) -> list[Path]:
    """Write a run's figures (the module docstring); returns the files.

    Raises:
        ValueError: the run has no ``metrics.jsonl``.
    """
    import matplotlib

    if not (path := Path(run_dir) / "metrics.jsonl").is_file():
        raise ValueError(f"{path}: no such file; hint: molt plot takes a run directory made by "
                         "molt run")
    matplotlib.use("Agg")
    series = {key: [(math.nan if step is None else float(step), value) for _, step, value in rows]
              for key, rows in read_points(Path(run_dir)).items()}
    draw = (_reward, _eval, _logprob_diff, _collapse, _staleness, _time, _expert_load)
    return _save({f.__name__[1:]: f(series) for f in draw}, Path(run_dir) / "plots")


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 3.5))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return figure, ax


def _lines(series: Series, keys: Sequence[str], title: str, ylabel: str) -> Any:
    keys = [k for k in keys if k in series]
    if not keys:
        return None
    figure, ax = _figure(title, "train step", ylabel)
    for key in keys:
        ax.plot(*zip(*series[key]), marker=".", label=key)
    ax.legend(fontsize=7)
    return figure


def _reward(series: Series) -> Any:
    return _lines(series, ["train/reward/mean"], "reward", "mean reward")


def _logprob_diff(series: Series) -> Any:
    return _lines(series, ["train/logprob_diff/abs_mean", "train/logprob_diff/abs_max"],
                  "trainer vs rollout logprobs (incl. staleness)", "|difference| (nats)")


def _collapse(series: Series) -> Any:
    keys = _ending(series, "/entropy/mean", "/collapse/identical_groups_frac",
                   "/collapse/zero_variance_frac")
    return _lines(series, keys, "collapse: entropy and degenerate groups", "nats / share of groups")


def _eval(series: Series) -> Any:
    keys = [k for k in _ending(series, "/accuracy") if f"{k}_stderr" in series]
    if not keys:
        return None
    figure, ax = _figure("held-out accuracy (greedy), +- 1 s.e.", "policy version", "accuracy")
    for key in keys:
        (steps, values), (_, errors) = zip(*series[key]), zip(*series[f"{key}_stderr"])
        ax.errorbar(steps, values, yerr=errors, marker="o", capsize=3, label=key)
    ax.legend(fontsize=7)
    return figure


def _staleness(series: Series) -> Any:
    if "train/lag/max" not in series:
        return None
    figure, ax = _figure("staleness per step", "largest token lag (versions)", "train steps")
    lags = [int(v) for _, v in series["train/lag/max"]]
    ax.hist(lags, bins=range(min(lags), max(lags) + 2), align="left", rwidth=0.8)
    ax.set_xticks(range(min(lags), max(lags) + 1))
    return figure


def _time(series: Series) -> Any:
    parts = {"train steps": "train/step_seconds", "weight export": "train/export_seconds",
             "refits": "rollout/refit_seconds", "evaluations": "evaluate/seconds"}
    totals = {label: sum(v for _, v in series[key]) for label, key in parts.items()
              if key in series}
    if "rollout/generate_seconds" in series:  # first request to the end, logged once
        totals["generation (wall)"] = series["rollout/generate_seconds"][-1][1]
    if not totals:
        return None
    figure, ax = _figure("time per stage (summed over the run)", "seconds", "")
    ax.barh(list(totals), list(totals.values()))
    return figure


def _expert_load(series: Series) -> Any:
    shares = [k for k in sorted(series) if k.startswith("train/moe/expert_share/")]
    if not shares:
        return None
    figure, ax = _figure("expert load (MoE), all layers", "train step", "share of top-k slots")
    for key in shares:
        ax.plot(*zip(*series[key]), marker=".", label=key.rsplit("/", 1)[1])
    ax.axhline(1 / len(shares), color="grey", linestyle=":", label="balanced")
    if "train/moe/load_max" in series:
        twin = ax.twinx()
        twin.plot(*zip(*series["train/moe/load_max"]), color="black", linestyle="--",
                  label="load_max")
        twin.set_ylabel("busiest expert / layer mean (dashed)")
    ax.legend(fontsize=7, ncol=2)
    return figure


def plot_sweeps(sweep_dirs: Sequence[Path]) -> list[Path]:
    """Write the figures of one sweep or several (the module docstring); returns the files.

    Raises:
        ValueError: a folder without ``sweep.json``.
    """
    import matplotlib

    matplotlib.use("Agg")
    sweeps = {}
    unique = len({Path(d).name for d in sweep_dirs}) == len(sweep_dirs)
    for d in sweep_dirs:
        if not (Path(d) / "sweep.json").is_file():
            raise ValueError(f"{d}: no sweep.json; hint: molt plot takes one run folder, or sweep "
                             "folders made by molt sweep")
        sweeps[Path(d).name if unique else str(d)] = json.loads(Path(d, "sweep.json").read_text())
    keys = dict.fromkeys(k for s in sweeps.values() for k in s.get("curves", {}))
    figures = {f"sweep_{key.replace('/', '_')}": _sweep_curve(sweeps, key) for key in keys}
    if any("threshold" in s for s in sweeps.values()):
        figures["sweep_threshold"] = _sweep_threshold(sweeps)
    return _save(figures, Path(sweep_dirs[0]) / "plots")


def _sweep_curve(sweeps: dict[str, Any], key: str) -> Any:
    figure, ax = _figure(f"{key}: mean of seeds, 95% interval", "policy version", key)
    for i, (label, sweep) in enumerate(sweeps.items()):
        color, curve = f"C{i}", sweep.get("curves", {}).get(key)
        if not curve:
            continue
        for seed in sweep["seeds"]:
            points = [(int(v), c["per_seed"][str(seed)]) for v, c in curve.items()
                      if str(seed) in c["per_seed"]]
            if points:
                ax.plot(*zip(*points), color=color, alpha=0.25, linewidth=0.8)
        ax.plot([int(v) for v in curve], [c["mean"] for c in curve.values()], color=color,
                marker="o", label=f"{label} (n = {max(c['n'] for c in curve.values())})")
        bands = [(int(v), *c["ci"]) for v, c in curve.items() if c["ci"] is not None]
        if bands:
            versions, low, high = zip(*bands)
            ax.fill_between(versions, low, high, color=color, alpha=0.2)
    ax.legend(fontsize=7)
    return figure


def _sweep_threshold(sweeps: dict[str, Any]) -> Any:
    figure, ax = _figure("time to threshold per seed (x: never, at the longest run's end)",
                         "minutes from the start of molt run", "")
    per_seed = [list(s.get("threshold", {}).get("per_seed", {}).values()) for s in sweeps.values()]
    ends = [(r.get("wall_s") or 0) / 60 for s in sweeps.values() for r in s["runs"].values()]
    edge = max([r["seconds"] / 60 for rows in per_seed for r in rows if r is not None] + ends,
               default=1.0)
    for row, rows in enumerate(per_seed):
        times = [r["seconds"] / 60 for r in rows if r is not None]
        ax.scatter(times, [row] * len(times), marker="o", alpha=0.7, color=f"C{row}")
        never = sum(r is None for r in rows)
        ax.scatter([edge] * never, [row] * never, marker="x", color=f"C{row}")
        ax.annotate(f" {never} never" if never else "", (edge, row), fontsize=7)
    limits = [s.get("threshold", {}) for s in sweeps.values()]
    ax.set_yticks(range(len(sweeps)), [f"{label}\n{t.get('metric', '')} >= {t.get('value', '')}"
                                       for label, t in zip(sweeps, limits)])
    ax.set_xlim(0, edge * 1.05)
    return figure
