"""``molt sweep``: one run of a pipeline per seed, and what the seeds say together.

Seed K runs as ``molt run PIPELINE --seed K --run-dir DIR/seed_K``, one at a time (all at once
on Ray). Again with the same pipeline and ``--set`` values, it keeps finished seeds and resumes
the others. ``DIR/sweep.json``, rewritten after every run::

    runs:      {"0": {"status": "ok", "wall_s": 702.1, "started_unix": ..., "starts": 1}, ...}
    results:   {name: stats.summarize of the ok seeds' values, with "per_seed"}
    curves:    {key: {step: the same}} per results metric logged at two steps or more
    threshold: {"metric", "value", "lower_bound", "per_seed": {"0": {"seconds": 431.0,
               "version": 16} or null (never)}, "success_rate", "median_seconds"}

Time to threshold counts from the seed's first start; the median counts "never" as later than
any time (null when more than half never reached it).
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from functools import partial
from math import inf
from pathlib import Path
from typing import Any

import click

from molt.commands.run import SET, check_torchvision, make_required
from molt.runtime.checkpoint import complete_checkpoints, replica_names
from molt.runtime.metrics import get_logger
from molt.runtime.pipeline import Pipeline
from molt.runtime.placement import catch_stop_signals, start_child, stop_signals_deferred

log = get_logger("sweep")
SWEEP_FILE = "sweep.json"
Points = dict[str, list[tuple[float, int | None, float]]]  # key -> [(unix time, step, value)]


@click.command("sweep")
@click.argument("pipeline", type=click.Path())
@click.option("--seeds", type=int, required=True, help="seeds 0 .. N-1, one run each")
@click.option("--out", type=click.Path(),
              help="the sweep's folder (default: runs/PIPELINE-sweep); again: resume it")
@click.option("--threshold", metavar="KEY=VALUE",
              help="time to threshold per seed, e.g. evaluate/accuracy=0.7")
@click.option("--lower-bound", is_flag=True,
              help="the threshold is reached when the value minus its KEY_stderr reaches it")
@SET
def command(pipeline: str, seeds: int, out: str | None, threshold: str | None, lower_bound: bool,
            overrides: tuple[str, ...]) -> int:
    """Run a pipeline once per seed, and summarise the seeds (sweep.json)."""
    if lower_bound and not threshold:
        raise ValueError("--lower-bound applies to --threshold; got no --threshold; "
                         "hint: --threshold KEY=VALUE")
    limit = Threshold.parse(threshold, lower_bound) if threshold else None
    check_torchvision()
    sweep = Sweep(pipeline, list(overrides), Path(out or f"runs/{Path(pipeline).stem}-sweep"),
                  seeds, limit)
    catch_stop_signals()
    code = sweep.run()
    click.echo(sweep.out / SWEEP_FILE)
    return code


@dataclass(frozen=True)
class Threshold:
    """``--threshold evaluate/accuracy=0.7`` (``lower_bound``: value minus its ``_stderr``)."""

    metric: str
    value: float
    lower_bound: bool = False

    @classmethod
    def parse(cls, text: str, lower_bound: bool = False) -> Threshold:
        """Raises: ValueError: not ``KEY=NUMBER``."""
        key, _, value = text.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        if not key.strip() or not math.isfinite(number):
            raise ValueError(f"--threshold {text!r}: expected KEY=NUMBER, e.g. "
                             "evaluate/accuracy=0.7")
        return cls(key.strip(), number, lower_bound)


def read_points(run_dir: Path) -> Points:
    """Every metric value of a run's ``metrics.jsonl``, in file order."""
    points: Points = {}
    path = run_dir / "metrics.jsonl"
    for line in path.read_text().splitlines() if path.is_file() else []:
        entry = json.loads(line)
        for key, value in entry["values"].items():
            points.setdefault(key, []).append((entry["time"], entry.get("step"), float(value)))
    return points


class Sweep:
    """The runs of one pipeline over seeds in ``out`` (the module docstring).

    Raises:
        ValueError: no seed, a pipeline that fails to load, or an ``out`` with another sweep.
    """

    def __init__(self, pipeline: str, overrides: list[str], out: Path, num_seeds: int,
                 threshold: Threshold | None = None) -> None:
        self.pipeline = os.path.normpath(pipeline)  # ./x.yaml is x.yaml
        self.overrides, self.out, self.threshold = list(overrides), Path(out), threshold
        self.pipe = Pipeline.from_yaml(pipeline, overrides)  # every problem before any run
        self.pipe.preflight()
        if num_seeds < 1:
            raise ValueError(f"--seeds: a sweep needs at least one seed; got {num_seeds}; "
                             "hint: --seeds 5")
        if not self.pipe.spec.results:
            log.warning("%s has no results: map, so sweep.json will hold no statistics; hint: "
                        "--set 'results={accuracy: evaluate/accuracy}'", pipeline)
        self.seeds = list(range(num_seeds))
        self.runs: dict[str, dict[str, Any]] = self._previous_runs()
        self.names = replica_names(self.pipe.checkpointed())
        self._offsets: dict[int, int] = {}  # the live table's position in each metrics.jsonl
        self._latest_values: dict[int, dict[str, float]] = {}

    def _previous_runs(self) -> dict[str, dict[str, Any]]:
        path = self.out / SWEEP_FILE
        if not path.is_file():
            return {}
        old = json.loads(path.read_text())
        if (old["pipeline"], old["overrides"]) != (self.pipeline, self.overrides):
            raise ValueError(f"{self.out}: holds a sweep of {old['pipeline']} with --set "
                             f"{old['overrides']}; got {self.pipeline} with --set "
                             f"{self.overrides}; hint: pass another --out")
        return old["runs"]

    def _ok(self, seed: int) -> bool:
        return self.runs.get(str(seed), {}).get("status") == "ok"

    def run(self) -> int:
        """Run every seed not finished yet, then write ``sweep.json``; 0 if every seed's run is
        ok, 1 if one failed, 130 if interrupted (each running seed is sent SIGINT)."""
        from rich.console import Console
        from rich.live import Live

        todo = [k for k in self.seeds if not self._ok(k)]
        if todo and (code := make_required(self.pipe, self.out)) != 0:  # outside the seeds' time
            return code
        at_once = len(todo) if self.pipe.spec.placement.backend == "ray" else 1
        running: dict[int, subprocess.Popen[bytes]] = {}
        live = Live(console=Console(stderr=True), refresh_per_second=1) if sys.stderr.isatty() \
            else None
        with live or contextlib.nullcontext():
            try:
                while todo or running:
                    # 1) start seeds while there is room  2) collect the finished ones  3) show
                    while todo and len(running) < at_once:
                        seed = todo.pop(0)
                        with stop_signals_deferred():
                            running[seed] = self._start(seed)
                    for seed, proc in list(running.items()):
                        if proc.poll() is not None:
                            self._finished(seed, running.pop(seed).returncode)
                    self._show(live, running)
                    time.sleep(1.0)
            except KeyboardInterrupt:
                log.warning("interrupted: stopping %d run(s); `molt sweep` again resumes them",
                            len(running))
                for proc in running.values():  # own sessions: the terminal's Ctrl-C reached only us
                    proc.send_signal(signal.SIGINT)
                for seed, proc in running.items():
                    self._finished(seed, proc.wait())
                return 130
            finally:
                self.write()
        return 0 if all(self._ok(k) for k in self.seeds) else 1

    def _start(self, seed: int) -> subprocess.Popen[bytes]:
        """``molt run`` of one seed: resumed from its newest complete checkpoint, else anew."""
        run_dir = self.out / f"seed_{seed}"
        args = [sys.executable, "-m", "molt", "run", self.pipeline, "--seed", str(seed)]
        args += [a for item in self.overrides for a in ("--set", item)]
        resume = (run_dir / "pipeline.yaml").is_file() and complete_checkpoints(run_dir, self.names)
        if not resume and run_dir.exists():
            log.warning("%s: no complete checkpoint; restarting it", run_dir)
            shutil.rmtree(run_dir)
        args += ["--resume" if resume else "--run-dir", str(run_dir)]
        run_dir.mkdir(parents=True, exist_ok=True)
        entry = self.runs.setdefault(str(seed), {"starts": 0})
        if not resume:  # time to threshold counts from the start of the run that is kept
            entry["started_unix"] = time.time()
        entry.update(status="running", starts=entry["starts"] + 1)
        log.info("seed %d: %s", seed, " ".join(args[3:]))
        self.write()
        with open(self.out / f"seed_{seed}.log", "ab") as out:
            return subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,
                                    preexec_fn=partial(start_child, None, signal.SIGTERM))

    def _finished(self, seed: int, code: int) -> None:
        path, log_path = self.out / f"seed_{seed}" / "summary.json", self.out / f"seed_{seed}.log"
        summary = json.loads(path.read_text()) if path.is_file() else {}
        status = summary.get("status", "failed") if code in (0, 1, 130) else "failed"
        error = summary.get("error") or (None if status == "ok" else log_path.read_text()[-2000:])
        self.runs[str(seed)].update(status=status, wall_s=summary.get("wall_s"), error=error)
        (log.info if status == "ok" else log.error)("seed %d: %s (exit %d)%s", seed, status, code,
                                                   "" if status == "ok" else f"; see {log_path}")
        self.write()

    def _show(self, live: Any, running: dict[int, Any]) -> None:
        if live is None:
            return
        from rich.table import Table

        table = Table(title=f"sweep {self.out}: {self.pipe.spec.name}, {len(self.seeds)} seeds")
        names = list(self.pipe.spec.results)[:4]
        for column in ("seed", "state", "min", *names):
            table.add_column(column)
        for k in self.seeds:
            entry = self.runs.get(str(k), {})
            latest = self._latest(k) if entry else {}
            seconds = entry.get("wall_s") or 0
            if k in running:
                seconds = time.time() - entry["started_unix"]
            table.add_row(str(k), entry.get("status", "waiting"),
                          f"{seconds / 60:.1f}" if entry else "",
                          *(f"{latest[n]:.4g}" if n in latest else "" for n in names))
        live.update(table)

    def _latest(self, seed: int) -> dict[str, float]:
        """The latest value of each ``results:`` metric of a seed's run (new lines read)."""
        path = self.out / f"seed_{seed}" / "metrics.jsonl"
        latest = self._latest_values.setdefault(seed, {})
        keys = {key: name for name, key in self.pipe.spec.results.items()}
        if path.is_file():
            with open(path) as f:
                f.seek(self._offsets.get(seed, 0))
                while (line := f.readline()).endswith("\n"):
                    self._offsets[seed] = f.tell()
                    values = json.loads(line)["values"]
                    latest.update({keys[k]: v for k, v in values.items() if k in keys})
        return latest

    def write(self) -> dict[str, Any]:
        """Summarise the finished seeds into ``sweep.json``; returns what it wrote."""
        ok = [k for k in self.seeds if self._ok(k)]
        data: dict[str, Any] = {"pipeline": self.pipeline, "overrides": self.overrides,
                                "seeds": self.seeds, "runs": self.runs}
        started = {k: self.runs[str(k)]["started_unix"] for k in ok}
        data.update(summarize_runs({k: self.out / f"seed_{k}" for k in ok}, self.pipe.spec.results,
                                   self.threshold, started))
        self.out.mkdir(parents=True, exist_ok=True)
        tmp = self.out / f".{SWEEP_FILE}.tmp"
        tmp.write_text(json.dumps(data, indent=1))
        tmp.replace(self.out / SWEEP_FILE)
        return data


def summarize_runs(run_dirs: dict[int, Path], results: dict[str, str], threshold: Threshold | None,
                   started: dict[int, float]) -> dict[str, Any]:
    """``results``, ``curves`` and ``threshold`` of sweep.json over finished runs by seed."""
    from molt.commands.stats import summarize  # scipy: imported by a sweep, not by every command

    summaries = {k: json.loads((d / "summary.json").read_text()) for k, d in run_dirs.items()}
    points = {k: read_points(d) for k, d in run_dirs.items()}
    out: dict[str, Any] = {"results": {}, "curves": {}}
    for name in results:
        per_seed = {str(k): s["results"].get(name) for k, s in summaries.items()
                    if s["results"].get(name) is not None}
        if per_seed:
            out["results"][name] = {**summarize(list(per_seed.values())), "per_seed": per_seed}
    for key in dict.fromkeys(k for k in results.values()
                             if not k.endswith(("_stderr", "policy_version"))):
        by_step: dict[int, dict[str, float]] = {}
        for k, series in points.items():
            for _, step, value in series.get(key, []):
                if step is not None:
                    by_step.setdefault(step, {})[str(k)] = value  # logged twice (resume): the later
        if len(by_step) > 1:  # a curve, not a value logged once
            out["curves"][key] = {str(s): {**summarize(list(v.values())), "per_seed": v}
                                  for s, v in sorted(by_step.items())}
    if threshold is not None:
        out["threshold"] = _time_to_threshold(points, threshold, started)
    return out


def _time_to_threshold(points: dict[int, Points], threshold: Threshold,
                       started: dict[int, float]) -> dict[str, Any]:
    from molt.commands.stats import first_reach

    per_seed: dict[str, dict[str, Any] | None] = {}
    for k, series in points.items():
        stderr = {t: v for t, _, v in series.get(f"{threshold.metric}_stderr", [])}
        rows = series.get(threshold.metric, [])
        timed = [(t - started[k], v, stderr.get(t)) for t, _, v in rows]
        if not rows:
            log.warning("seed %d logged no %r: counted as never reaching it; hint: a metric key of "
                        "its metrics.jsonl", k, threshold.metric)
        reached = first_reach(timed, threshold.value, threshold.lower_bound)
        hit = next((i for i, point in enumerate(timed) if point[0] == reached), None)
        per_seed[str(k)] = None if hit is None else {"seconds": round(timed[hit][0], 1),
                                                     "version": rows[hit][1]}
    times = [inf if r is None else r["seconds"] for r in per_seed.values()]
    median = statistics.median(times or [inf])
    return {"metric": threshold.metric, "value": threshold.value,
            "lower_bound": threshold.lower_bound, "per_seed": per_seed,
            "success_rate": sum(t < inf for t in times) / max(len(times), 1),
            "median_seconds": None if median == inf else round(median, 1)}


def arm_values(arm: str, metric: str) -> dict[str, float]:
    """One arm of ``molt compare``: by run name, ``metric`` (a ``results:`` name, else a metric
    key) of a sweep folder's ok seeds, of run folders joined by commas, or of a JSON file
    ``{"runs": [{"name": "seed0", "results": {"accuracy_final": 0.81}}, ...]}``.

    Raises:
        ValueError: a path that is none of these, or a run without ``metric``.
    """
    path = Path(arm)
    if (path / SWEEP_FILE).is_file():
        sweep = json.loads((path / SWEEP_FILE).read_text())
        summaries = {f"seed_{k}": _summary(path / f"seed_{k}") for k in sweep["seeds"]
                     if sweep["runs"].get(str(k), {}).get("status") == "ok"}
    elif path.is_file():
        try:
            listed = json.loads(path.read_text())["runs"]
        except (ValueError, KeyError, TypeError):
            listed = None
        if not isinstance(listed, list) or not all(isinstance(r, dict) for r in listed):
            raise ValueError(f"{arm}: not a JSON file of the form "
                             "{\"runs\": [{\"results\": {...}}, ...]}")
        summaries = {str(r.get("name", i)): r for i, r in enumerate(listed)}
    else:
        names = [name.strip() for name in arm.split(",") if name.strip()]
        summaries = {name: _summary(Path(name)) for name in names}
    values = {}
    for name, summary in summaries.items():
        value = summary.get("results", {}).get(metric, summary.get("metrics", {}).get(metric))
        if value is None:
            raise ValueError(f"{arm}: run {name} has no {metric!r}; its results: "
                             f"{sorted(summary.get('results', {}))}")
        values[name] = float(value)
    return values


def _summary(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    if not path.is_file():
        raise ValueError(f"{run_dir}: not a finished run (no summary.json) nor a sweep "
                         f"(no {SWEEP_FILE})")
    summary = json.loads(path.read_text())
    if summary.get("status") != "ok":
        log.warning("%s: status %s; its values are those it had when it stopped", run_dir,
                    summary.get("status"))
    return summary
