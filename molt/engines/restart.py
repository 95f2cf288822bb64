"""A rollout's engine, restarted when it dies or hangs, the groups it had in flight retried on the new one.

A dead engine (its process killed, crashed, or taken by the OOM killer) fails every request and
refit in flight with `EngineDeadError` (`Engine.tracked`). Each group that failed so calls
`EngineRestarter.restart` with the restart generation it ran under (a refit that failed so calls
it itself); the first call closes the dead engine, starts a new one (as at setup) and brings it to
the newest weight record the dead one held or was loading, by a verified refit (or to a newer one
waiting; molt.engines.refit); the other calls wait for it. Then each group is run again whole:
none of a failed attempt's rows was sent, so no sample is lost or duplicated, and the new tokens
carry the version they are generated with, never older than at admission (``max_staleness``
holds). More than ``max`` restarts within ``window_s`` seconds fail the run, naming the last cause.
Streamed refits (``transport: nccl``) cannot be repeated, so an engine that takes them is not
restarted.

A hung engine (a deadlocked or stopped engine core) is made dead: every ``hang_s / 4`` seconds (at most
5) ``hang_loop`` asks the current engine how long it has had work in flight without an output
(`Engine.stalled_s`); at ``hang_s`` or more it counts ``engine_hangs``, warns, and `Engine.kill`s it
(vLLM: SIGKILL to its engine core and workers), which fails its work with `EngineDeadError`: it is
restarted as a dead one, within the same ``max``. An idle engine is never hung, nor one that takes
streamed refits (its refit waits for the slowest peer, and it cannot be restarted). vLLM reports a
request's output only when it ends, so ``hang_s`` must exceed the longest time between two completions
(a batch of long ones started together); the run's ``watchdog_s`` (molt.runtime.runner) must exceed ``hang_s``
and a restart, or it stops the run first. A new engine that dies or hangs while it loads the weights
is one more death, and is replaced in turn.

Example: ``engine_restarts: {max: 2, window_s: 600, hang_s: 300}`` (the rollout stage's key, the default):
an engine with 8 requests in flight and no output for 300 s is killed, restarted, its groups run again; a
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
    """How often a dead engine is restarted, and when a silent one is hung (rollout key ``engine_restarts``)."""

    model_config = ConfigDict(extra="forbid")
    max: int = Field(2, ge=0, description="restarts allowed within window_s; one more fails the run (0: never)")
    window_s: float = Field(600.0, gt=0, description="the window, in seconds")
    hang_s: float | None = Field(300.0, gt=0, description="seconds an engine with work in flight (requests, a "
                                 "refit) may go without an output; then it is hung: killed and restarted (None: never)")


class EngineRestarter:
    """Holds the current engine (`engine`) and restarts it (module docstring)."""

    def __init__(self, config: RestartConfig, start: Callable[[], Engine], log: logging.Logger,
                 metrics: MetricsWriter, port: Any = None) -> None:
        self.config, self.start, self.log, self.metrics = config, start, log, metrics
        self.port = port  # the rollout's weights input (molt.runtime.ports.InputPort); None: no refits
        self.engine = start()
        self.generation = 0  # restarts so far: a group that failed under an older one just retries
        self.holders: list[Any] = []  # objects whose ``engine`` attribute follows the current engine
        self.weights: pa.RecordBatch | None = None  # the newest weight record loaded or loading: a new engine's
        self.restarting = False
        self.starting: Engine | None = None  # the new engine while a restart brings it to the newest weights
        self._times: list[float] = []
        self._refused: RuntimeError | None = None
        self._lock = asyncio.Lock()
        self._hang_task: asyncio.Task[None] | None = None

    async def refit(self, item: Any = None, engine: Engine | None = None) -> float | None:
        """`refit_from` the weights port (``item``, or a newer record waiting) into ``engine`` (default: the
        current one; nothing while a restart is loading a new one), as work in flight on it
        (`Engine.tracked`); the seconds it took, or None. Remembers the record, which a restarted engine loads: an engine that dies
        during the refit is restarted here, with the record it was loading.

        Raises:
            RuntimeError: a failed refit (molt.engines.refit), or from `restart`.
        """
        self._watch()
        if self.port is None or engine is None and self.restarting:
            return None
        target, generation = engine or self.engine, self.generation
        await self.port.drain_nowait()  # the newest record waiting (else ``item``), taken here so that a
        item = self.port.latest() or item  # restart still has it
        if not isinstance(item, pa.RecordBatch):
            return None
        self.weights = item
        try:
            done = await target.tracked("refit", lambda: refit_from(target, self.port, item))
        except EngineDeadError as error:
            if engine is not None:  # a restart's own refit: its caller sees the new engine die
                raise
            await self.restart(generation, error)
            return None
        if done is None:
            return None
        self.weights = done[1]  # a newer one if the file of the first was gone (refit_from)
        self.metrics.log({"refit_seconds": done[0], "policy_version": target.policy_version})
        return done[0]

    async def retrying(self, attempt: Callable[[], Awaitable[T]], counter: str = "groups_retried") -> T:
        """``await attempt()``, again on a restarted engine each time it fails with `EngineDeadError`
        (counted: ``counter``, ``engine_restarts``).

        Raises:
            RuntimeError: from `restart`.
        """
        self._watch()
        while True:
            generation = self.generation
            try:
                return await attempt()
            except EngineDeadError as error:
                await self.restart(generation, error)
                self.metrics.count(counter)

    async def restart(self, generation: int, error: EngineDeadError) -> Engine:
        """The engine to retry on: a new one at the newest weights (`refit` of the remembered record);
        a new one that dies (or hangs) while it loads them is one more death, and is replaced in turn.

        Raises:
            RuntimeError: over ``max`` restarts within ``window_s``, or an engine taking streamed
                refits, naming the cause.
        """
        async with self._lock:
            if self._refused is not None:  # the same death, seen by another group
                raise self._refused
            if generation != self.generation:  # another group restarted it already
                return self.engine
            dead, now = self.engine, time.monotonic()
            self.restarting = True  # the rollout's own refits wait: they would load into the dead engine
            try:
                while True:
                    self._count_death(dead, error)
                    with contextlib.suppress(Exception):  # it is dead: closing is only tidying up
                        dead.close()
                    engine = self.starting = self.start()  # synchronous: vLLM's start holds the loop (tens of s)
                    try:
                        if self.weights is not None:  # at the newest version before anyone generates on it
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
        """Count one more restart (``engine_restarts``) within ``window_s``, or refuse it (`restart`)."""
        now = time.monotonic()
        self._times = [t for t in self._times if now - t < self.config.window_s] + [now]
        if len(self._times) > self.config.max or dead.streams_weights:
            why = ("it takes streamed refits, which cannot be repeated" if dead.streams_weights else
                   f"{len(self._times)} deaths within {self.config.window_s:.0f} s, over engine_restarts.max "
                   f"{self.config.max}")
            self._refused = RuntimeError(f"the engine died and is not restarted ({why}): {error}")
            raise self._refused from error
        self.metrics.count("engine_restarts")
        self.log.warning("the engine died (%s); restarting it (restart %d within %.0f s; it was at version %d) and "
                         "retrying the groups it had in flight", error, len(self._times), self.config.window_s,
                         dead.policy_version)

    def _watch(self) -> None:
        """Start ``hang_loop`` once, in the running event loop (before the first refit or group)."""
        if self.config.hang_s is not None and self._hang_task is None:
            self._hang_task = asyncio.create_task(self.hang_loop(), name="engine_hang_loop")

    async def hang_loop(self) -> None:
        """Kill the current engine whenever it is hung (module docstring); runs until `close`."""
        assert self.config.hang_s is not None, "started only with hang_s"
        while True:
            await asyncio.sleep(min(self.config.hang_s / 4, 5.0))
            self.check_hung()

    def check_hung(self) -> bool:
        """`Engine.kill` the current engine if it is hung (``hang_s``, module docstring); True if it was."""
        engine, hang_s = self.starting or self.engine, self.config.hang_s  # a new one may hang in its first refit
        if hang_s is None or engine.killed is not None or engine.streams_weights or \
                (stalled_s := engine.stalled_s()) < hang_s:  # a streamed refit waits for its slowest peer
            return False
        why = f"the engine hung: no output for {stalled_s:.0f} s, {engine.num_in_flight} requests or refits in flight"
        self.log.warning("%s (engine_restarts.hang_s %g); killing it to restart it", why, hang_s)
        self.metrics.count("engine_hangs")
        engine.kill(why)
        return True

    def close(self) -> None:
        """Stop ``hang_loop``; idempotent (the engine is its holders' to close)."""
        if self._hang_task is not None:
            self._hang_task.cancel()
