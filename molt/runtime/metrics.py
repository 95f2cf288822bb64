"""Logging and metrics: one logger, ``[stage/replica]`` prefixes, JSON-lines metrics.

Each replica appends to ``RUN_DIR/metrics/{stage}.{replica}.jsonl`` lines of ``{"time": s, "stage":
id, "replica": r, "step": k|null, "values": {"stage/key": number}, "reduce": {"stage/key":
"sum"|"mean"|"last"|"max"}}``; ``reduce`` says how to combine replicas (default ``last``).
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
    """The logger of one stage replica, with a ``[stage/replica]`` prefix."""
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
    """JSON-lines metrics of one stage replica: for stage ``reward``, ``log({"score_mean": 0.5})``
    writes ``"reward/score_mean": 0.5``; ``count("rows_out", 16)`` adds to a summed total."""

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
        if self._file is None or not values:
            return
        prefixed = {f"{self.stage_id}/{k}": float(v) for k, v in values.items()}
        red = {f"{self.stage_id}/{k}": r for k, r in (reduce or {}).items()}
        line = {"time": time.time(), "stage": self.stage_id, "replica": self.replica,
                "step": step, "values": prefixed, "reduce": red}
        self._file.write(json.dumps(line) + "\n")

    def count(self, key: str, amount: float = 1.0, flush_every_s: float = 0.5) -> None:
        """Add to a counter, written at most every ``flush_every_s`` seconds."""
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
    """Each key of a metrics file (None or absent: none) -> the steps it was logged at."""
    steps: dict[str, set[int]] = {}
    for line in path.read_text().splitlines() if path is not None and path.is_file() else []:
        rec = json.loads(line)
        for key in rec["values"] if rec.get("step") is not None else ():
            steps.setdefault(key, set()).add(rec["step"])
    return steps


def drop_torn_line(path: Path) -> None:
    """Cut a last line a killed process left without its newline (never merged)."""
    if not path.is_file() or path.stat().st_size == 0:
        return
    with open(path, "rb+") as f:
        data = f.read()
        if not data.endswith(b"\n"):
            f.truncate(data.rfind(b"\n") + 1)
