"""The body of one stage process: ``python -m molt.runtime.worker RUN_DIR STAGE REPLICA``.

It loads the pipeline and wiring from the run directory, builds the stage with its ports, and::

    1) connect inputs and say hello     2) setup() (+ load_checkpoint when resuming)
    3) wait for every consumer's hello  4) run the stage's loop
    5) send end-of-stream downstream    6) close()

On failure it sends an error frame on every output, writes its traceback to
``RUN_DIR/status/{stage}.{replica}.json`` and exits 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import faulthandler
import json
import logging
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import pyarrow as pa
import zmq.asyncio

from molt.runtime.checkpoint import read_replica_state, write_json_atomic
from molt.runtime.curve import run_keys, start_authenticator
from molt.runtime.edges import (Barrier, EdgeSpec, ProtocolError, UpstreamError, decode_batch,
                                encode_batch)
from molt.runtime.metrics import MetricsWriter
from molt.runtime.pipeline import Edge, Pipeline, StageNode
from molt.runtime.ports import InputPort, OutputPort
from molt.runtime.recording import RecordWriter, edge_dirname
from molt.runtime.stage import Stage, StageContext


def edge_spec(pipe: Pipeline, wiring: dict[str, Any], edge: Edge) -> EdgeSpec:
    w = wiring[edge.name]
    assert edge.schema is not None
    return EdgeSpec(edge.name, edge.cfg.kind, tuple(w["endpoints"]), tuple(w["consumers"]),
                    edge.schema, edge.cfg.key, edge.cfg.capacity, edge.cfg.hwm,
                    pipe.spec.ready_timeout_s, w.get("curve"), edge.cfg.max_message_mib << 20)


class GroupInput:
    """An input of a torchrun group: rank 0 receives each item and broadcasts it over gloo."""

    def __init__(self, port: InputPort | None, schema: pa.Schema, group: Any) -> None:
        self.port, self.schema, self.group = port, schema, group

    async def start(self) -> None:
        if self.port is not None:
            await self.port.start()

    async def recv(self, timeout_s: float | None = None) -> pa.RecordBatch | Barrier | None:
        import torch
        import torch.distributed as dist

        header = torch.zeros(2, dtype=torch.int64)
        payload = b""
        if self.port is not None:
            item = await self.port.recv(timeout_s)
            if isinstance(item, pa.RecordBatch):
                payload = encode_batch(item).to_pybytes()
            header[0] = 0 if item is None else 1 if isinstance(item, Barrier) else 2
            header[1] = item.step if isinstance(item, Barrier) else len(payload)
        dist.broadcast(header, src=0, group=self.group)
        kind, size = int(header[0]), int(header[1])
        if kind != 2:
            return None if kind == 0 else Barrier(size)
        data = (torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload
                else torch.empty(size, dtype=torch.uint8))
        dist.broadcast(data, src=0, group=self.group)
        return decode_batch(data.numpy().tobytes(), self.schema, "torchrun group broadcast")

    def close(self) -> None:
        if self.port is not None:
            self.port.close()


class NullOutput:
    """An output on ranks other than 0: rank 0 alone sends."""

    async def wait_ready(self) -> None: ...
    async def send(self, batch: pa.RecordBatch) -> None: ...
    async def send_barrier(self, step: int) -> None: ...
    async def send_end(self) -> None: ...
    async def wait_delivered(self) -> None: ...
    async def send_error(self, stage: str, error: str) -> None: ...
    def close(self) -> None: ...


def build_stage(pipe: Pipeline, wiring: dict[str, Any], node: StageNode, replica: int,
                run_dir: Path, zctx: zmq.asyncio.Context, rank: int, world_size: int,
                group: Any) -> Stage:
    """The stage, its ports wired for this process."""
    name = f"{node.id}.{replica}"
    resume_from, recorded = (resume_plan(run_dir, name) if node.id in pipe.checkpointed()
                             else (None, {}))
    ctx = StageContext(node.id, replica, node.replicas, run_dir, rank, world_size,
                       resume_from=resume_from, seed=pipe.spec.seed,
                       subscribed={e.src_port for e in pipe.edges if e.src == node.id})
    suffix = "" if world_size == 1 else f".rank{rank}"
    metrics = run_dir / "metrics" / f"{name}{suffix}.jsonl" if rank == 0 else None
    ctx.metrics = MetricsWriter(metrics, node.id, replica)
    for port in node.inputs:
        edges = [e for e in pipe.edges if e.dst == node.id and e.dst_port == port]
        specs = [edge_spec(pipe, wiring, e) for e in edges]
        if world_size == 1:
            ctx.inputs[port] = InputPort(zctx, port, specs, name)
        else:
            real = InputPort(zctx, port, specs, name) if rank == 0 else None
            ctx.inputs[port] = GroupInput(real, specs[0].schema, group)  # type: ignore[assignment]
    for port in node.outputs:
        edges = [e for e in pipe.edges if e.src == node.id and e.src_port == port]
        if world_size > 1 and rank != 0:
            ctx.outputs[port] = NullOutput()  # type: ignore[assignment]
            continue
        record = run_dir / "record"
        recorders = {e.name: RecordWriter(record / edge_dirname(e.name) / f"{name}.arrow",
                                          recorded.get(e.name, 0))
                     for e in edges if e.cfg.record and rank == 0}
        ends = [(edge_spec(pipe, wiring, e), replica) for e in edges]
        ctx.outputs[port] = OutputPort(zctx, port, ends, name, recorders)
    return node.cls(node.config, ctx)


async def run_stage(stage: Stage) -> None:
    """Steps 2-6 of the module docstring."""
    ctx = stage.ctx
    try:
        stage.setup()
        if ctx.resume_from is not None:
            stage.load_checkpoint(ctx.resume_from)
        for out in ctx.outputs.values():
            await out.wait_ready()
        await stage.run()  # type: ignore[attr-defined]
        for out in ctx.outputs.values():
            await out.send_end()
        for out in ctx.outputs.values():
            await out.wait_delivered()
    except BaseException as exc:
        text = "".join(traceback.format_exception(exc))
        for out in ctx.outputs.values():
            with contextlib.suppress(Exception):  # best effort while failing
                await asyncio.wait_for(out.send_error(ctx.stage_id, text), timeout=2.0)
        raise
    finally:
        stage.close()
        if ctx.metrics is not None:
            ctx.metrics.close()


async def run_process(pipe: Pipeline, wiring: dict[str, Any], stage_id: str, replica: int,
                      run_dir: Path, rank: int = 0, world_size: int = 1) -> None:
    """Run one stage replica (or rank of its torchrun group) in this process."""
    group = None
    if world_size > 1:
        import torch
        import torch.distributed as dist

        backend = "cpu:gloo,cuda:nccl" if torch.cuda.is_available() else "gloo"
        dist.init_process_group(backend=backend)
        group = dist.new_group(backend="gloo")
    zctx = zmq.asyncio.Context()
    keys = next((w["curve"] for w in wiring.values() if w.get("curve")), None)
    auth = start_authenticator(zctx, run_keys(keys)) if keys else None  # before any server binds
    node = pipe.stages[stage_id]
    stage = build_stage(pipe, wiring, node, replica, run_dir, zctx, rank, world_size, group)
    try:
        for inp in stage.ctx.inputs.values():  # 1) connect and say hello before any (slow) setup
            await inp.start()
        await run_stage(stage)
    finally:
        ports: list[Any] = [*stage.ctx.inputs.values(), *stage.ctx.outputs.values()]
        for p in ports:
            p.close()
        if auth is not None:
            auth.stop()
        zctx.term()
        if world_size > 1:  # gloo's threads left to the interpreter's exit can abort a rank
            dist.destroy_process_group()


def resume_plan(run_dir: Path, name: str) -> tuple[Path | None, dict[str, int]]:
    """(checkpoint folder replica ``name`` restores from, batches to keep per recorded edge)
    per ``RUN_DIR/resume.json``; (None, {}) for a fresh start or, not ``strict``, no state there.

    Raises:
        ValueError: a strict resume whose checkpoint has no state for ``name``.
    """
    path = run_dir / "resume.json"
    if not path.is_file():
        return None, {}
    plan = json.loads(path.read_text())
    folder = Path(plan["checkpoint"])
    if not plan.get("strict", True) and not (folder / f"{name}.json").is_file():
        return None, {}
    recorded = read_replica_state(folder, name)["recorded"]
    return folder, recorded if plan.get("keep_records", True) else {}


def write_status(run_dir: Path, name: str, state: str, error: str = "",
                 upstream: bool = False) -> None:
    """Atomically write this process's status file for the runner."""
    status = {"state": state, "error": error, "upstream": upstream, "time": time.time(),
              "pid": os.getpid()}
    write_json_atomic(run_dir / "status" / f"{name}.json", status)


def main(argv: list[str] | None = None) -> int:
    faulthandler.register(signal.SIGUSR1, all_threads=True)  # stacks into the log, for the watchdog
    run_dir, stage_id, replica = (argv or sys.argv[1:])[:3]
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    run_path = Path(run_dir)
    name = f"{stage_id}.{replica}" + (f".rank{rank}" if world_size > 1 else "")
    logging.basicConfig(format=f"%(asctime)s [{name} %(name)s] %(levelname)s %(message)s",
                        datefmt="%H:%M:%S")
    logging.getLogger("molt").setLevel(logging.INFO)
    try:
        pipe = Pipeline.from_yaml(run_path / "pipeline.yaml")
        wiring = json.loads((run_path / "wiring.json").read_text())
        asyncio.run(run_process(pipe, wiring, stage_id, int(replica), run_path, rank, world_size))
    except BaseException as exc:  # noqa: BLE001 - report any failure to the runner
        text = "".join(traceback.format_exception(exc))
        # upstream: caused by another stage (error frame, consumer gone, malformed message)
        upstream = isinstance(exc, (UpstreamError, ProtocolError))
        write_status(run_path, name, "failed", text, upstream=upstream)
        print(text, file=sys.stderr, flush=True)
        return 1
    write_status(run_path, name, "done")
    return 0


if __name__ == "__main__":
    sys.exit(main())
