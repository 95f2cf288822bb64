"""Targets a run applies to its own metric lines: ``stop_when: {metric: evaluate/accuracy,
at_least: 0.7}`` ends the run cleanly at the first line that reaches the value; ``keep_best:
evaluate/accuracy`` keeps the checkpoint at the metric's highest value from pruning."""

from __future__ import annotations

import difflib
from collections.abc import Iterable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from molt.runtime.metrics import get_logger

log = get_logger("runner")


class StopWhen(BaseModel):
    """``stop_when:``: the metric and the value that end the run (exit 0)."""

    model_config = ConfigDict(extra="forbid")
    metric: str = Field(description="a metric key, STAGE/NAME, e.g. evaluate/accuracy")
    at_least: float = Field(description="the value to reach")
    lower_bound: bool = Field(False, description="reach it with the value minus METRIC_stderr of "
                              "the same line; a line without one does not count")

    def met(self, values: dict[str, float]) -> bool:
        """Whether a metric line's ``values`` (holding ``metric``) meet the target."""
        stderr = values.get(f"{self.metric}_stderr")
        if self.lower_bound and stderr is None:
            if self.metric not in _warned:
                _warned.add(self.metric)
                log.warning("stop_when.lower_bound: %s has no %s_stderr beside it; such lines do "
                            "not count", self.metric, self.metric)
            return False
        margin = (stderr or 0.0) if self.lower_bound else 0.0
        return values[self.metric] - margin >= self.at_least


_warned: set[str] = set()  # metrics whose missing _stderr was reported


def check_metric_keys(stop_when: StopWhen | None, keep_best: str | None, stages: Iterable[str],
                      source: str) -> None:
    """Refuse a ``stop_when.metric`` or ``keep_best`` that names no stage.

    Raises:
        ValueError: naming the file, the key and the stages there are.
    """
    for key, metric in _named(stop_when, keep_best).items():
        if metric.split("/")[0] not in (known := sorted(stages)):
            raise ValueError(f"{source}: {key}: {metric!r} names no stage (metric keys are "
                             f"STAGE/NAME, e.g. evaluate/accuracy); stages: {known}")


def _named(stop_when: StopWhen | None, keep_best: str | None) -> dict[str, str]:
    named = {"stop_when.metric": stop_when.metric if stop_when else None, "keep_best": keep_best}
    return {key: metric for key, metric in named.items() if metric is not None}


def moment(rec: dict[str, Any], value: float, start_unix: float) -> dict[str, Any]:
    """A line's value, step and seconds since ``start_unix`` (None: logged before it)."""
    since = rec["time"] - start_unix
    time_s = round(since, 1) if since >= 0 else None
    return {"value": value, "step": rec.get("step"), "time_s": time_s}


def warn_unlogged(stop_when: StopWhen | None, keep_best: str | None, logged: Iterable[str]) -> None:
    """Warn of a ``stop_when.metric`` or ``keep_best`` no process logged, naming close keys."""
    known = list(logged)
    for key, metric in _named(stop_when, keep_best).items():
        if metric not in known:
            log.warning("%s: no process logged %r; closest logged keys: %s", key, metric,
                        difflib.get_close_matches(metric, known, n=3, cutoff=0.5))
