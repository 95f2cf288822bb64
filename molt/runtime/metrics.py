"""Logging and metrics: one logger, ``[stage/replica]`` prefixes, JSON-lines metrics.

Each stage replica appends its metrics to ``RUN_DIR/metrics/{stage}.{replica}.jsonl``;
the runner merges every file into ``RUN_DIR/metrics.jsonl`` and draws live progress
from them. A metric line is ``{"time": s, "stage": id, "replica": r, "step": k|null,
"values": {"stage/key": number}, "reduce": {"stage/key": "sum"|"mean"|"last"|"max"}}``;
``reduce`` says how the runner combines replicas (default ``last``).
"""

from __future__ import annotations

import json
import logging
import sys
import time
from pathlib import Path
from typing import Literal

Reduction = Literal["sum", "mean", "last", "max"]


def get_logger(prefix: str) -> logging.Logger:
    """The ``molt`` logger for one stage replica, with a ``[stage/replica]`` prefix."""
    logger = logging.getLogger(f"molt.{prefix}")
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter(f"%(asctime)s [{prefix}] %(levelname)s %(message)s",
                                               "%H:%M:%S"))
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False
    return logger


class MetricsWriter:
    """Append-only JSON-lines metrics of one stage replica.

    ``log({"score_mean": 0.5}, step=3)`` writes ``"reward/score_mean": 0.5`` for stage
    ``reward``. ``count("rows_out", 16)`` accumulates a running total (reduced by sum).
    """

    def __init__(self, path: Path | None, stage_id: str, replica: int) -> None:
        self.stage_id, self.replica = stage_id, replica
        self.counters: dict[str, float] = {}
        self._file = None
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            drop_torn_line(path)
            self._file = open(path, "a", buffering=1)  # line-buffered: the runner tails it
        self._last_flush = 0.0

    def log(self, values: dict[str, float], step: int | None = None,
            reduce: dict[str, Reduction] | None = None) -> None:
        """Write one metrics line (none for no values); keys get the ``stage/`` prefix."""
        if self._file is None or not values:
            return
        prefixed = {f"{self.stage_id}/{k}": float(v) for k, v in values.items()}
        red = {f"{self.stage_id}/{k}": r for k, r in (reduce or {}).items()}
        line = {"time": time.time(), "stage": self.stage_id, "replica": self.replica,
                "step": step, "values": prefixed, "reduce": red}
        self._file.write(json.dumps(line) + "\n")

    def count(self, key: str, amount: float = 1.0, flush_every_s: float = 0.5) -> None:
        """Add to a running counter; written at most every ``flush_every_s`` seconds."""
        self.counters[key] = self.counters.get(key, 0.0) + amount
        if time.monotonic() - self._last_flush >= flush_every_s:
            self.flush_counters()

    def flush_counters(self) -> None:
        if self.counters:
            self.log(self.counters, reduce={k: "sum" for k in self.counters})
        self._last_flush = time.monotonic()

    def close(self) -> None:
        """Write the final counters and close (idempotent)."""
        if self._file is not None:
            self.flush_counters()
            self._file.close()
            self._file = None


def logged_steps(path: Path | None) -> dict[str, set[int]]:
    """Each key of a metrics file (a resumed replica's own; None or absent: none) -> the steps it was logged at."""
    steps: dict[str, set[int]] = {}
    for line in path.read_text().splitlines() if path is not None and path.is_file() else []:
        rec = json.loads(line)
        for key in rec["values"] if rec.get("step") is not None else ():
            steps.setdefault(key, set()).add(rec["step"])
    return steps


def drop_torn_line(path: Path) -> None:
    """Cut a last line that a killed process left without its newline, before appending to ``path``
    (a resumed replica's metrics file: the runner merges whole lines only, so it never merged that
    one; a run's ``metrics.jsonl`` after ``molt run`` itself was killed)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
