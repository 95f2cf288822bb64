"""The Stage base class: a stage author writes hooks, the base owns the loop and the sockets.

Kinds: `Source` (``generate()``), `Transform` (``process(batch)``, ``flush()``; a sink declares
``outputs = {}``), `Service` (``async run()`` calling ``recv`` and ``send``). Optional hooks:
``setup()``, an idempotent ``close()``, ``state_dict()``/``load_state_dict()`` (JSON, saved at
each checkpoint barrier, restored after ``setup()`` on resume) and ``save_checkpoint`` /
``load_checkpoint`` for bulky state (calling ``super()`` last).
"""

from __future__ import annotations

import asyncio
import logging
import os
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import pyarrow as pa
from pydantic import BaseModel, ConfigDict

from molt.runtime.checkpoint import checkpoint_dir, read_replica_state, write_json_atomic
from molt.runtime.edges import Barrier
from molt.runtime.metrics import MetricsWriter, get_logger
from molt.runtime.ports import InputPort, OutputPort
from molt.runtime.seeds import derive_seed

SCRATCH_ENV = "MOLT_SCRATCH"  # the run's scratch folder, set by the runner for its workers


def scratch_folder(prefix: str) -> Path:
    """A new folder in the run's scratch folder (removed after the run), else /dev/shm or tmp."""
    base = os.environ.get(SCRATCH_ENV) or ("/dev/shm" if os.path.isdir("/dev/shm") else None)
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def run_owned(path: Path) -> bool:
    """Whether ``path`` lies in the run's scratch folder."""
    scratch = os.environ.get(SCRATCH_ENV)
    return scratch is not None and Path(path).resolve().is_relative_to(Path(scratch).resolve())


class StageConfig(BaseModel):
    """Base of every stage's nested ``Config``: unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class Port:
    """Column contract of one named input or output: the columns an input ``reads``
    (trajectory column names or ``pa.Field`` s), those an output ``writes`` on top of what the
    input it ``passes`` carries, or a fixed ``schema``. An ``optional`` output may have no edge."""

    reads: tuple[str | pa.Field, ...] = ()
    writes: tuple[str | pa.Field, ...] = ()
    passes: str | None = None
    schema: pa.Schema | None = None
    optional: bool = False


@dataclass
class StageContext:
    """Where a stage replica runs. ``rank``/``world_size`` are its torchrun group's."""

    stage_id: str
    replica: int = 0
    num_replicas: int = 1
    run_dir: Path | None = None
    rank: int = 0
    world_size: int = 1
    inputs: dict[str, InputPort] = field(default_factory=dict)
    outputs: dict[str, OutputPort] = field(default_factory=dict)
    metrics: MetricsWriter | None = None
    resume_from: Path | None = None  # the checkpoint folder to restore from
    seed: int = 0  # the pipeline's seed
    subscribed: set[str] = field(default_factory=set)  # outputs with at least one edge

    def seed_for(self, *parts: object) -> int:
        """``derive_seed(seed, stage_id, *parts)``; pass the replica where replicas must differ."""
        return derive_seed(self.seed, self.stage_id, *parts)


def preflight_fields(config: Any, where: str) -> None:
    """Call ``preflight(where)`` of every sub-config that has one, at any depth, ``where`` being
    its YAML path."""
    if isinstance(config, BaseModel) and callable(preflight := getattr(config, "preflight", None)):
        preflight(where)
    elif isinstance(config, BaseModel | dict):
        items = (config.items() if isinstance(config, dict)
                 else ((k, getattr(config, k)) for k in type(config).model_fields))
        for key, value in items:
            preflight_fields(value, f"{where}.{key}")


class Stage:
    """Base of all stages; the hooks are in the module docstring."""

    Config: ClassVar[type[StageConfig]] = StageConfig
    inputs: ClassVar[dict[str, Port]] = {}
    outputs: ClassVar[dict[str, Port]] = {}
    drops_groups: ClassVar[bool] = False  # a filter of whole groups (see check_group_filters)

    def __init__(self, config: StageConfig, ctx: StageContext) -> None:
        self.config, self.ctx = config, ctx
        who = ctx.replica if ctx.world_size == 1 else ctx.rank
        self.log: logging.Logger = get_logger(f"{ctx.stage_id}/{who}")
        self.metrics = ctx.metrics or MetricsWriter(None, ctx.stage_id, ctx.replica)

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        """The (inputs, outputs) port contracts; override when they depend on config."""
        return dict(cls.inputs), dict(cls.outputs)

    @classmethod
    def preflight(cls, config: StageConfig, where: str) -> None:
        """Check files and datasets before any process starts; raise ValueError naming ``where``."""
        preflight_fields(config, where)

    def setup(self) -> None:
        """Load models, open files; runs after the sockets are connected."""

    def close(self) -> None:
        """Release resources; must be idempotent."""

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state saved at a checkpoint barrier ({} = stateless)."""
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what :meth:`state_dict` returned."""

    def save_checkpoint(self, folder: Path) -> None:
        """Write ``{stage}.{replica}.json`` on rank 0; an override writes its files first."""
        if self.ctx.rank != 0:
            return
        recorded = {name: rec.num_batches for out in self.ctx.outputs.values()
                    for name, rec in getattr(out, "recorders", {}).items()}
        write_json_atomic(folder / f"{self.ctx.stage_id}.{self.ctx.replica}.json",
                          {"state": self.state_dict(), "recorded": recorded})

    def load_checkpoint(self, folder: Path) -> None:
        """Restore from checkpoint ``folder`` after ``setup()``."""
        state = read_replica_state(folder, f"{self.ctx.stage_id}.{self.ctx.replica}")["state"]
        if state:
            self.load_state_dict(state)

    async def send(self, port: str, batch: pa.RecordBatch) -> None:
        """Send a batch on output ``port``; a no-op on ranks other than 0 of a torchrun group."""
        out = self.ctx.outputs.get(port)
        if out is None:
            raise ValueError(f"stage {self.ctx.stage_id!r}: no output port {port!r}; "
                             f"declared {sorted(self.ctx.outputs)}")
        await out.send(batch)
        self.metrics.count(f"rows_out_{port}" if port != "out" else "rows_out", batch.num_rows)

    async def end(self, port: str) -> None:
        """Send end of stream on ``port`` before ``run()`` returns."""
        await self.ctx.outputs[port].send_end()

    async def recv(self, port: str = "in",
                   timeout_s: float | None = None) -> pa.RecordBatch | Barrier | None:
        """Next batch or barrier from input ``port``; None at end of stream."""
        item = await self.ctx.inputs[port].recv(timeout_s)
        if isinstance(item, pa.RecordBatch):
            self.metrics.count(f"rows_in_{port}" if port != "in" else "rows_in", item.num_rows)
        return item

    async def barrier(self, step: int) -> None:
        """Checkpoint barrier ``step``: save the checkpoint, then forward the barrier."""
        if self.ctx.run_dir is not None:
            self.save_checkpoint(checkpoint_dir(self.ctx.run_dir, step))
        for out in self.ctx.outputs.values():
            await out.send_barrier(step)


class Source(Stage):
    """A stage with no input that yields record batches."""

    outputs: ClassVar[dict[str, Port]] = {"out": Port()}

    def generate(self) -> Iterator[pa.RecordBatch | Barrier]:
        raise NotImplementedError

    async def run(self) -> None:
        for item in self.generate():
            # 1) produce  2) send (a barrier checkpoints and travels downstream)
            if isinstance(item, Barrier):
                await self.barrier(item.step)
            else:
                await self.send("out", item)


class Transform(Stage):
    """A stage that maps each input batch to zero or one output batch."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port()}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in")}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        raise NotImplementedError

    def flush(self) -> pa.RecordBatch | None:
        """At end of stream: emit what is still held (None = nothing)."""
        return None

    async def run(self) -> None:
        while True:
            # 1) receive
            item = await self.recv("in")
            if item is None:
                break
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            # 2) process  3) send
            await self.emit(self.process(item))
        await self.emit(self.flush())

    async def emit(self, result: pa.RecordBatch | None) -> None:
        """Send what `process` or `flush` returned on ``out``; overridden to send more."""
        if result is not None and "out" in self.ctx.outputs:
            await self.send("out", result)
        elif result is not None:
            raise ValueError(f"stage {self.ctx.stage_id!r} returned a batch but has no output "
                             "port; hint: a sink's process() returns None")


class Service(Stage):
    """A long-lived stage that runs its own async loop (``async def run``)."""

    async def run(self) -> None:
        raise NotImplementedError


async def first_failure(main: asyncio.Task[Any], others: list[asyncio.Task[Any]]) -> None:
    """Wait for ``main``; raise the first error of it or of ``others``."""
    waiting = {main, *others}
    while not main.done():
        done, waiting = await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
        for task in done:
            if not task.cancelled() and task.exception() is not None:
                main.cancel()
                raise task.exception()  # type: ignore[misc]
