"""Live progress of a run: merges each replica's metrics into ``RUN_DIR/metrics.jsonl`` and draws
a table on a terminal, else logs a line every ``log_every_s`` seconds."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table

from molt.runtime.metrics import drop_torn_line, get_logger
from molt.runtime.pipeline import Pipeline
from molt.runtime.targets import moment

log = get_logger("runner")


class Progress:
    """Context manager: ``with Progress(pipe, run_dir, live) as p: p.update(elapsed_s)``."""

    def __init__(self, pipe: Pipeline, run_dir: Path, live: bool, log_every_s: float = 10.0):
        self.pipe, self.run_dir, self.live = pipe, Path(run_dir), live
        self.start_unix = time.time()
        # each `results:` key -> [[seconds since start, value], ...]
        self.history: dict[str, list[list[float]]] = {key: [] for key in pipe.spec.results.values()}
        self.offsets: dict[Path, int] = {}
        self.values: dict[str, dict[str, tuple[float, float]]] = {}  # key -> replica -> (time, v)
        self.reduce: dict[str, str] = {}
        self.reached: dict[str, Any] | None = None  # the first line that met stop_when
        self.best: dict[str, Any] | None = None  # the highest value of keep_best's metric
        self.best_logged_step = -1  # checkpoints after it may yet be best
        self.log_every_s, self._last_log = log_every_s, 0.0
        self._live: Live | None = None
        self.run_dir.mkdir(parents=True, exist_ok=True)
        drop_torn_line(self.run_dir / "metrics.jsonl")
        self.merged = _merged_lines(self.run_dir / "metrics.jsonl")
        self._out = open(self.run_dir / "metrics.jsonl", "a")

    def __enter__(self) -> Progress:
        if self.live:
            self._live = Live(console=Console(stderr=True), refresh_per_second=4, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)
        self._out.close()

    def update(self, elapsed_s: float) -> None:
        """Read new metric lines and redraw."""
        for f in sorted((self.run_dir / "metrics").glob("*.jsonl")):
            self._read(f)
        self._out.flush()
        if self._live is not None:
            self._live.update(self._table(elapsed_s))
        elif time.monotonic() - self._last_log >= self.log_every_s:
            self._last_log = time.monotonic()
            rows = self.summary()
            brief = "  ".join(f"{k} {v:g}" for k, v in rows.items()
                              if k.endswith(("rows_in", "rows_out")))
            alarms = "  ".join(f"COLLAPSE {sid}: {', '.join(_collapse(rows, sid))}"
                               for sid in self.pipe.stages
                               if rows.get(f"{sid}/collapse/alarms", 0) > 0)
            line = "  ".join(filter(None, [brief, alarms])) or "starting"
            (log.warning if alarms else log.info)("%.0f s  %s", elapsed_s, line)

    def _read(self, path: Path) -> None:
        with open(path) as f:
            f.seek(self.offsets.get(path, 0))
            while line := f.readline():
                if not line.endswith("\n"):
                    break  # still being written
                self.offsets[path] = f.tell()
                source = ".".join(path.name.split(".")[:2])  # stage.replica
                if self.merged.get(source, 0) > 0:  # merged already (a resumed run)
                    self.merged[source] -= 1
                else:
                    self._out.write(line)
                rec = json.loads(line)
                for k, v in rec["values"].items():
                    if k in self.history:
                        self.history[k].append([round(rec["time"] - self.start_unix, 1), v])
                    replica = f"{rec['stage']}.{rec['replica']}"
                    self.values.setdefault(k, {})[replica] = (rec["time"], v)
                self.reduce.update(rec.get("reduce", {}))
                values, stop = rec["values"], self.pipe.spec.stop_when
                best = values.get(self.pipe.spec.keep_best)
                if (self.reached is None and stop and stop.metric in values
                        and rec["time"] >= self.start_unix  # not a resumed run's earlier lines
                        and stop.met(values)):
                    self.reached = moment(rec, values[stop.metric], self.start_unix)
                if best is not None:
                    self.best_logged_step = max(self.best_logged_step, rec.get("step") or 0)
                    if self.best is None or best > self.best["value"]:
                        self.best = moment(rec, best, self.start_unix)

    def summary(self) -> dict[str, float]:
        """The latest value of every metric key, combined across replicas by its reduction."""
        out = {}
        for k, per in self.values.items():
            vals = [v for _, v in per.values()]
            how = self.reduce.get(k, "last")
            out[k] = (sum(vals) if how == "sum" else max(vals) if how == "max"
                      else sum(vals) / len(vals) if how == "mean" else max(per.values())[1])
        return out

    def _table(self, elapsed_s: float) -> Table:
        agg = self.summary()
        table = Table(title=f"{self.pipe.spec.name}  {elapsed_s:.0f} s  {self.run_dir}")
        for col in ("stage", "replicas", "rows in", "rows out", "rows/s", "latest"):
            table.add_column(col)
        for sid in self.pipe.topo_order():
            n = self.pipe.stages[sid]
            rows_in, rows_out = agg.get(f"{sid}/rows_in", 0), agg.get(f"{sid}/rows_out", 0)
            extra = [f"{k.split('/', 1)[1]} {v:.3g}" for k, v in agg.items()
                     if k.startswith(f"{sid}/") and not k.split("/", 1)[1].startswith("rows_")][:4]
            if agg.get(f"{sid}/collapse/alarms", 0) > 0:
                extra = ["[bold red]COLLAPSE[/]", *_collapse(agg, sid)]
            rate = (rows_out or rows_in) / max(elapsed_s, 1e-9)
            table.add_row(sid, str(n.replicas), f"{rows_in:g}", f"{rows_out:g}", f"{rate:.1f}",
                          "  ".join(extra))
        return table


def _collapse(values: dict[str, float], sid: str) -> list[str]:
    keys = ("collapse/identical_wrong_frac", "collapse/identical_groups_frac",
            "collapse/zero_variance_frac", "entropy/mean")
    return [f"{k} {values[f'{sid}/{k}']:.3g}" for k in keys if f"{sid}/{k}" in values]


def _merged_lines(path: Path) -> dict[str, int]:
    """``{stage}.{replica}`` -> its lines that ``path`` holds already (a resumed run's)."""
    counts: dict[str, int] = {}
    if path.is_file():
        for line in path.read_text().splitlines():
            rec = json.loads(line)
            name = f"{rec['stage']}.{rec['replica']}"
            counts[name] = counts.get(name, 0) + 1
    return counts
