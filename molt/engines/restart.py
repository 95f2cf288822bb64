"""A rollout's engine, restarted when it dies, the groups it had in flight retried on the new one.

A dead engine (its process killed, crashed, or taken by the OOM killer) fails every request in
flight with `EngineDeadError`. Each group that failed so calls `EngineRestarter.restart` with the
restart generation it ran under; the first call closes the dead engine, starts a new one (as
at setup) and brings it to the policy version the dead one held by a verified refit of the same
weight record (or a newer one waiting; molt.engines.weights); the other calls wait for it. Then
each group is run again whole: none of a failed attempt's rows was sent, so no sample is lost or
duplicated, and the new tokens carry the version they are generated with, never older than at
admission (``max_staleness`` holds). More than ``max`` restarts within ``window_s`` seconds fail
the run, naming the last cause. Streamed refits (``transport: nccl``) cannot be repeated, so an
engine that takes them is not restarted.

Example: ``engine_restarts: {max: 2, window_s: 600}`` (the rollout stage's key, the default).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, Field

from molt.engines.base import Engine, EngineDeadError
from molt.engines.weights import refit_from
from molt.metrics import MetricsWriter

T = TypeVar("T")


class RestartConfig(BaseModel):
    """How often a dead engine is restarted (rollout stage key ``engine_restarts``)."""

    model_config = ConfigDict(extra="forbid")
    max: int = Field(2, ge=0, description="restarts allowed within window_s; one more fails the run (0: never)")
    window_s: float = Field(600.0, gt=0, description="the window, in seconds")


class EngineRestarter:
    """Holds the current engine (`engine`) and restarts it (module docstring)."""

    def __init__(self, config: RestartConfig, start: Callable[[], Engine], log: logging.Logger,
                 metrics: MetricsWriter, port: Any = None) -> None:
        self.config, self.start, self.log, self.metrics = config, start, log, metrics
        self.port = port  # the rollout's weights input (molt.ports.InputPort); None: no refits
        self.engine = start()
        self.generation = 0  # restarts so far: a group that failed under an older one just retries
        self.holders: list[Any] = []  # objects whose ``engine`` attribute follows the current engine
        self.weights: Any = None  # the last weight record applied, for the new engine
        self.restarting = False
        self._times: list[float] = []
        self._refused: RuntimeError | None = None
        self._lock = asyncio.Lock()

    async def refit(self, item: Any = None, engine: Engine | None = None) -> float | None:
        """`refit_from` the weights port into ``engine`` (default: the current one; nothing while a
        restart is loading a new one); the seconds it took, or None. Remembers the record applied,
        which a restarted engine loads again."""
        if self.port is None or engine is None and self.restarting:
            return None
        done = await refit_from(engine or self.engine, self.port, item)
        if done is None:
            return None
        self.weights = done[1]
        return done[0]

    async def retrying(self, attempt: Callable[[], Awaitable[T]]) -> T:
        """``await attempt()``, again on a restarted engine each time it fails with `EngineDeadError`
        (counted: ``groups_retried``, ``engine_restarts``).

        Raises:
            RuntimeError: from `restart`.
        """
        while True:
            generation = self.generation
            try:
                return await attempt()
            except EngineDeadError as error:
                await self.restart(generation, error)
                self.metrics.count("groups_retried")

    async def restart(self, generation: int, error: EngineDeadError) -> Engine:
        """The engine to retry on: a new one at the dead one's version (`refit` of the last record).

        Raises:
            RuntimeError: over ``max`` restarts within ``window_s``, or an engine taking streamed
                refits, naming the cause.
        """
        async with self._lock:
            if self._refused is not None:  # the same death, seen by another group
                raise self._refused
            if generation != self.generation:  # another group restarted it already
                return self.engine
            now = time.monotonic()
            self._times = [t for t in self._times if now - t < self.config.window_s] + [now]
            if len(self._times) > self.config.max or self.engine.streams_weights:
                why = ("it takes streamed refits, which cannot be repeated" if self.engine.streams_weights else
                       f"{len(self._times)} deaths within {self.config.window_s:.0f} s, over engine_restarts.max "
                       f"{self.config.max}")
                self._refused = RuntimeError(f"the engine died and is not restarted ({why}): {error}")
                raise self._refused from error
            version = self.engine.policy_version
            self.log.warning("the engine died (%s); restarting it (restart %d within %.0f s) at version %d and "
                             "retrying the groups it had in flight", error, len(self._times), self.config.window_s,
                             version)
            with contextlib.suppress(Exception):  # it is dead: closing is only tidying up
                self.engine.close()
            self.restarting = True  # the rollout's own refits wait: they would load into the dead engine
            try:
                engine = self.start()  # synchronous: vLLM's start holds the event loop (tens of seconds)
                if version:  # at the dead one's version before anyone generates on it
                    await self.refit(self.weights, engine)
            finally:
                self.restarting = False
            self.engine = engine
            for holder in self.holders:
                holder.engine = engine
            self.generation += 1
            self.metrics.count("engine_restarts")
            self.log.info("engine restarted in %.1f s at version %d", time.monotonic() - now,
                          self.engine.policy_version)
            return self.engine
