"""A rollout's engine, restarted when it dies or hangs; the groups it had in flight are retried.

A dead engine fails all work in flight with `EngineDeadError`. The first group to meet it calls
`EngineRestarter.restart`: a new engine, brought by a verified refit to the newest weight record
the dead one held or was loading; the other groups wait. Each group runs again whole (none of its
rows was sent), so no sample is lost or duplicated. An engine taking streamed refits is never
restarted: they cannot be repeated.

A hung engine (work in flight, no output for ``hang_s``) is killed and restarted as a dead one.
vLLM reports an output only when a request ends, so ``hang_s`` must exceed the longest time
between two completions. Example: ``engine_restarts: {max: 2, window_s: 600, hang_s: 300}``: a
third death or hang within 600 s fails the run.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field

from molt.engines.base import Engine, EngineDeadError, T
from molt.engines.refit import refit_from
from molt.runtime.metrics import MetricsWriter


class RestartConfig(BaseModel):
    """How often a dead engine is restarted, and when a silent one is hung."""

    model_config = ConfigDict(extra="forbid")
    max: int = Field(2, ge=0, description="restarts allowed within window_s; one more fails")
    window_s: float = Field(600.0, gt=0, description="the window, in seconds")
    hang_s: float | None = Field(300.0, gt=0, description="seconds a busy engine may go without an "
                                 "output before it is killed and restarted (None: never)")


class EngineRestarter:
    """Holds the current engine (`engine`) and restarts it."""

    def __init__(self, config: RestartConfig, start: Callable[[], Engine], log: logging.Logger,
                 metrics: MetricsWriter, port: Any = None) -> None:
        self.config, self.start, self.log, self.metrics = config, start, log, metrics
        self.port = port  # the rollout's weights input (an InputPort); None: no refits
        self.engine = start()
        self.generation = 0  # restarts so far: a group that failed under an older one just retries
        self.holders: list[Any] = []  # objects whose ``engine`` attribute follows the current one
        self.weights: pa.RecordBatch | None = None  # the newest record loaded or loading
        self.restarting = False
        self.starting: Engine | None = None  # the new engine during a restart
        self._times: list[float] = []
        self._refused: RuntimeError | None = None
        self._lock = asyncio.Lock()
        self._hang_task: asyncio.Task[None] | None = None

    async def refit(self, item: Any = None, engine: Engine | None = None) -> float | None:
        """`refit_from` the newest record waiting (else ``item``) into ``engine`` (default: the
        current one, unless restarting); its seconds, or None. RuntimeError: a failed refit, or
        from `restart`."""
        self._watch()
        if self.port is None or engine is None and self.restarting:
            return None
        target, generation = engine or self.engine, self.generation
        await self.port.drain_nowait()  # taken here, so that a restart still has it
        item = self.port.latest() or item
        if not isinstance(item, pa.RecordBatch):
            return None
        self.weights = item
        try:
            done = await target.tracked("refit", lambda: refit_from(target, self.port, item))
        except EngineDeadError as error:
            if engine is not None:  # a restart's own refit: the restart handles it
                raise
            await self.restart(generation, error)
            return None
        if done is None:
            return None
        self.weights = done[1]  # a newer one if the file of the first was gone (refit_from)
        self.metrics.log({"refit_seconds": done[0], "policy_version": target.policy_version})
        return done[0]

    async def retrying(self, attempt: Callable[[], Awaitable[T]],
                       counter: str = "groups_retried") -> T:
        """``await attempt()``, again on a restarted engine each time it meets a dead one;
        RuntimeError from `restart`."""
        self._watch()
        while True:
            generation = self.generation
            try:
                return await attempt()
            except EngineDeadError as error:
                await self.restart(generation, error)
                self.metrics.count(counter)

    async def restart(self, generation: int, error: EngineDeadError) -> Engine:
        """The engine to retry on: a new one at the newest weights. RuntimeError, naming the cause,
        over ``max`` restarts within ``window_s`` or for an engine taking streamed refits."""
        async with self._lock:
            if self._refused is not None:  # the same death, seen by another group
                raise self._refused
            if generation != self.generation:  # another group restarted it already
                return self.engine
            dead, now = self.engine, time.monotonic()
            self.restarting = True  # the rollout's own refits would load into the dead engine
            try:
                while True:
                    self._count_death(dead, error)
                    with contextlib.suppress(Exception):  # it is dead: closing is only tidying up
                        dead.close()
                    engine = self.starting = self.start()  # synchronous: holds the loop
                    try:
                        if self.weights is not None:  # the newest version, before anyone generates
                            await self.refit(self.weights, engine)
                        break
                    except EngineDeadError as again:
                        dead, error = engine, again
            finally:
                self.restarting, self.starting = False, None
            self.engine = engine
            for holder in self.holders:
                holder.engine = self.engine
            self.generation += 1
            self.log.info("engine restarted in %.1f s at version %d", time.monotonic() - now,
                          self.engine.policy_version)
            return self.engine

    def _count_death(self, dead: Engine, error: EngineDeadError) -> None:
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.config.window_s] + [now]
        if len(self._times) > self.config.max or dead.streams_weights:
            why = ("it takes streamed refits, which cannot be repeated" if dead.streams_weights else
                   f"{len(self._times)} deaths within {self.config.window_s:.0f} s, over "
                   f"engine_restarts.max {self.config.max}")
            self._refused = RuntimeError(f"the engine died and is not restarted ({why}): {error}")
            raise self._refused from error
        self.metrics.count("engine_restarts")
        self.log.warning("%s; restarting the engine (restart %d within %.0f s; it was at version "
                         "%d) and retrying the groups it had in flight", error,
                         len(self._times), self.config.window_s, dead.policy_version)

    def _watch(self) -> None:
        if self.config.hang_s is not None and self._hang_task is None:
            self._hang_task = asyncio.create_task(self.hang_loop(), name="engine_hang_loop")

    async def hang_loop(self) -> None:
        assert self.config.hang_s is not None, "started only with hang_s"
        while True:
            await asyncio.sleep(min(self.config.hang_s / 4, 5.0))
            self.check_hung()

    def check_hung(self) -> bool:
        """Kill the current engine if hung (never one whose streamed refit awaits a peer)."""
        engine, hang_s = self.starting or self.engine, self.config.hang_s  # a new one may hang too
        if hang_s is None or engine.killed is not None or engine.streams_weights or \
                (stalled_s := engine.stalled_s()) < hang_s:
            return False
        why = (f"the engine hung: no output for {stalled_s:.0f} s, {engine.num_in_flight} requests "
               "or refits in flight")
        self.log.warning("%s (engine_restarts.hang_s %g); killing it to restart it", why, hang_s)
        self.metrics.count("engine_hangs")
        engine.kill(why)
        return True

    def close(self) -> None:
        """Stop ``hang_loop``; idempotent (the engine is its holders' to close)."""
        if self._hang_task is not None:
            self._hang_task.cancel()
