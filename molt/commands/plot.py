"""``molt plot RUN_DIR``: PNG curves of a run from its ``metrics.jsonl`` (matplotlib).

Writes into ``RUN_DIR/plots/``:

* ``reward.png``       mean reward of each train step (``train/reward/mean``)
* ``eval.png``         held-out accuracy per policy version with one standard error
                       (``*/accuracy``, ``*/accuracy_stderr`` of an evaluate stage)
* ``logprob_diff.png`` |trainer - rollout| logprob of the trained tokens per step, mean
                       and max (``train/logprob_diff/abs_mean``, ``abs_max``); a sample
                       generated k versions ago also differs by those k updates, so with
                       max_staleness 1 the max reaches nats on rare tokens
* ``collapse.png``     per step: the trainer's mean token entropy (nats, ``*/entropy/mean``)
                       and the shares of groups with identical completions and with
                       equal rewards (``*/collapse/*``, molt.train.collapse)
* ``staleness.png``    histogram of the steps' largest token lag (``train/lag/max``):
                       version trained at minus version generated with
* ``time.png``         seconds spent per stage, summed over the run: train steps,
                       weight export, refits, evaluations, and generation's wall time
                       (``rollout/generate_seconds``: first request to the end)
* ``expert_load.png``  MoE: each expert's share of the top-k routing slots per step, summed
                       over layers (``train/moe/expert_share/e*``), and the busiest expert's
                       load over its layer's mean (``train/moe/load_max``; 1 = balanced)

A figure whose metrics the run does not have is skipped (and not listed).

``molt plot SWEEP_DIR [SWEEP_DIR ...]`` (molt.commands.sweep): into the first folder's ``plots/``, per
curve of ``sweep.json`` (a results metric logged at policy versions) ``sweep_{key}.png``:
the seeds' mean with its 95% interval as a band, every seed faint behind it (several sweeps
overlaid, one colour each); and ``sweep_threshold.png``: each seed's time to the threshold,
"never" drawn at the right edge.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

Series = dict[str, list[tuple[float, float]]]  # metric key -> [(step or NaN, value)]


def read_series(run_dir: Path) -> Series:
    """Every metric value, in file order, from ``RUN_DIR/metrics.jsonl`` (step NaN when none).

    Raises:
        ValueError: the run has no ``metrics.jsonl``.
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"{path}: no such file; hint: molt plot takes a run directory made by molt run")
    series: Series = defaultdict(list)
    for line in path.read_text().splitlines():
        entry = json.loads(line)
        step = float("nan") if entry.get("step") is None else float(entry["step"])
        for key, value in entry["values"].items():
            series[key].append((step, float(value)))
    return series


def _ending(series: Series, suffix: str) -> list[str]:
    return sorted(k for k in series if k.endswith(suffix))


def plot_run(run_dir: Path) -> list[Path]:
    """Write the figures of the module docstring; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    series = read_series(run_dir)
    out = Path(run_dir) / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for name, draw in (("reward", _reward), ("eval", _eval), ("logprob_diff", _logprob_diff), ("collapse", _collapse),
                       ("staleness", _staleness), ("time", _time), ("expert_load", _expert_load)):
        figure = draw(series)
        if figure is not None:
            figure.savefig(out / f"{name}.png", dpi=100, bbox_inches="tight")
            written.append(out / f"{name}.png")
    return written


def _figure(title: str, xlabel: str, ylabel: str) -> tuple[Any, Any]:
    import matplotlib.pyplot as plt

    figure, ax = plt.subplots(figsize=(6, 3.5))
    ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
    ax.grid(alpha=0.3)
    return figure, ax


def _lines(series: Series, keys: Sequence[str], title: str, ylabel: str) -> Any:
    if not keys:
        return None
    figure, ax = _figure(title, "train step", ylabel)
    for key in keys:
        ax.plot(*zip(*series[key]), marker=".", label=key)
    ax.legend(fontsize=7)
    return figure


def _reward(series: Series) -> Any:
    return _lines(series, [k for k in ("train/reward/mean",) if k in series], "reward", "mean reward")


def _logprob_diff(series: Series) -> Any:
    keys = [k for k in ("train/logprob_diff/abs_mean", "train/logprob_diff/abs_max") if k in series]
    # a stale sample's tokens also differ by the updates since it was generated
    return _lines(series, keys, "trainer vs rollout logprobs (incl. staleness)", "|difference| (nats)")


def _collapse(series: Series) -> Any:
    keys = _ending(series, "/entropy/mean") + _ending(series, "/collapse/identical_groups_frac") \
        + _ending(series, "/collapse/zero_variance_frac")
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
    totals = {label: sum(v for _, v in series[key]) for label, key in parts.items() if key in series}
    if "rollout/generate_seconds" in series:  # wall time from the first request to the end (logged once)
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
        twin.plot(*zip(*series["train/moe/load_max"]), color="black", linestyle="--", label="load_max")
        twin.set_ylabel("busiest expert / layer mean (dashed)")
    ax.legend(fontsize=7, ncol=2)
    return figure


def plot_sweeps(sweep_dirs: Sequence[Path]) -> list[Path]:
    """Write the sweep figures of the module docstring for one sweep or several; returns the files.

    Raises:
        ValueError: a folder without ``sweep.json``.
    """
    import matplotlib

    matplotlib.use("Agg")
    sweeps = {}
    for d in sweep_dirs:
        if not (Path(d) / "sweep.json").is_file():
            raise ValueError(f"{d}: no sweep.json; hint: molt plot takes one run folder, or sweep folders made "
                             "by molt sweep")
        label = Path(d).name if len({Path(e).name for e in sweep_dirs}) == len(sweep_dirs) else str(d)
        sweeps[label] = json.loads((Path(d) / "sweep.json").read_text())
    out = Path(sweep_dirs[0]) / "plots"
    out.mkdir(exist_ok=True)
    written = []
    for key in dict.fromkeys(k for s in sweeps.values() for k in s.get("curves", {})):
        figure = _sweep_curve(sweeps, key)
        written.append(out / f"sweep_{key.replace('/', '_')}.png")
        figure.savefig(written[-1], dpi=100, bbox_inches="tight")
    if any("threshold" in s for s in sweeps.values()):
        written.append(out / "sweep_threshold.png")
        _sweep_threshold(sweeps).savefig(written[-1], dpi=100, bbox_inches="tight")
    return written


def _sweep_curve(sweeps: dict[str, Any], key: str) -> Any:
    figure, ax = _figure(f"{key}: mean of seeds, 95% interval", "policy version", key)
    for i, (label, sweep) in enumerate(sweeps.items()):
        color = f"C{i}"
        curve = sweep.get("curves", {}).get(key)
        if not curve:
            continue
        versions = [int(v) for v in curve]
        for seed in sweep["seeds"]:
            points = [(int(v), c["per_seed"][str(seed)]) for v, c in curve.items() if str(seed) in c["per_seed"]]
            if points:
                ax.plot(*zip(*points), color=color, alpha=0.25, linewidth=0.8)
        ax.plot(versions, [c["mean"] for c in curve.values()], color=color, marker="o",
                label=f"{label} (n = {max(c['n'] for c in curve.values())})")
        bands = [(int(v), *c["ci"]) for v, c in curve.items() if c["ci"] is not None]
        if bands:
            ax.fill_between(*zip(*[(v, lo) for v, lo, _ in bands]), [hi for *_, hi in bands], color=color, alpha=0.2)
    ax.legend(fontsize=7)
    return figure


def _sweep_threshold(sweeps: dict[str, Any]) -> Any:
    figure, ax = _figure("time to threshold per seed (x: never, at the longest run's end)",
                         "minutes from the start of molt run", "")
    ends = [(r.get("wall_s") or 0) / 60 for s in sweeps.values() for r in s["runs"].values()]
    reached = [r["seconds"] / 60 for s in sweeps.values() for r in s.get("threshold", {}).get("per_seed", {}).values()
               if r is not None]
    edge = max(reached + ends, default=1.0)
    for row, sweep in enumerate(sweeps.values()):
        per_seed = sweep.get("threshold", {}).get("per_seed", {}).values()
        times = [r["seconds"] / 60 for r in per_seed if r is not None]
        ax.scatter(times, [row] * len(times), marker="o", alpha=0.7, color=f"C{row}")
        never = sum(r is None for r in per_seed)
        ax.scatter([edge] * never, [row] * never, marker="x", color=f"C{row}")
        ax.annotate(f" {never} never" if never else "", (edge, row), fontsize=7)
    ax.set_yticks(range(len(sweeps)), [f"{label}\n{s.get('threshold', {}).get('metric', '')} >= "
                                       f"{s.get('threshold', {}).get('value', '')}" for label, s in sweeps.items()])
    ax.set_xlim(0, edge * 1.05)
    return figure
