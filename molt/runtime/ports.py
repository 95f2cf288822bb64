"""Ports: what a stage replica sees of its edges, as named inputs and outputs."""

from __future__ import annotations

import json
import time
from collections import deque
from typing import Any

import pyarrow as pa
import zmq
import zmq.asyncio

from molt.schema import conform
from molt.runtime.edges import (BARRIER, CREDIT, DATA, END, END_ACK, ERROR, Barrier, EdgeSpec,
                                InputEdge, OutputEdge, ProtocolError, SendBuffers, UpstreamError,
                                control_payload, decode_batch, encode_batch, split_frames)


class InputPort:
    """One named input, fed by every producer of its edges; a barrier is returned once it has
    come from them all."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, specs: list[EdgeSpec],
                 consumer_id: str):
        self.name = name
        self.edges = [InputEdge(ctx, s, consumer_id) for s in specs]
        self.poller = zmq.asyncio.Poller()
        self._open: dict[Any, str] = {}
        for edge in self.edges:
            for i, s in enumerate(edge.socks):
                self.poller.register(s, zmq.POLLIN)
                self._open[s] = f"edge {edge.spec.name} (producer {i} -> {consumer_id})"
        self._spec = {s: e.spec for e in self.edges for s in e.socks}
        self._ready: deque[pa.RecordBatch | Barrier] = deque()
        self._held: dict[Any, int] = {}  # producer socket -> barrier step it sent
        self._owed: dict[Any, int] = {}  # producer socket -> credits consumed, not yet returned

    async def start(self) -> None:
        for edge in self.edges:
            await edge.hello()

    async def recv(self, timeout_s: float | None = None) -> pa.RecordBatch | Barrier | None:
        """Next batch or barrier; None at end of stream.

        Raises:
            UpstreamError: a producer sent an error frame.
            ProtocolError: a malformed frame.
            TimeoutError: nothing arrived within ``timeout_s`` (when given).
        """
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while not self._ready:
            for sock in [s for s, n in self._owed.items() if n]:
                await self._return_credits(sock)  # never wait while holding back credits
            if not self._open:
                return None
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"input {self.name!r}: nothing within {timeout_s} s")
            for sock, _ in await self.poller.poll(timeout=200):
                await self._read(sock)
        return self._ready.popleft()

    def latest(self) -> pa.RecordBatch | None:
        """Broadcast inputs: the newest batch received, without waiting, dropping the rest."""
        batches = [item for item in self._ready if isinstance(item, pa.RecordBatch)]
        self._ready.clear()
        return batches[-1] if batches else None

    async def drain_nowait(self) -> None:
        for sock, _ in await self.poller.poll(timeout=0):
            await self._read(sock)

    async def _read(self, sock: Any) -> None:
        where, spec = self._open[sock], self._spec[sock]
        frames = await sock.recv_multipart(copy=False)
        kind, payload = split_frames(frames, where, spec.max_message_bytes)
        if kind == DATA:
            self._ready.append(decode_batch(payload, spec.schema, where))
            if spec.kind != "broadcast":
                self._owed[sock] = self._owed.get(sock, 0) + 1
                if self._owed[sock] >= max(1, spec.capacity // 2):
                    await self._return_credits(sock)
        elif kind == END:
            await sock.send_multipart([END_ACK, b""])  # the producer may close now
            sock.setsockopt(zmq.LINGER, 1_000)  # flush the ack on close
            del self._open[sock]
            self.poller.unregister(sock)
            self._release_if_aligned()
        elif kind == ERROR:
            stage, error = (str(control_payload(payload, key, where)) for key in ("stage", "error"))
            raise UpstreamError(stage, error)
        elif kind == BARRIER:
            step = control_payload(payload, "step", where)
            if not isinstance(step, int):
                raise ProtocolError(f"{where}: barrier step {step!r} is not an integer")
            self._held[sock] = step
            self.poller.unregister(sock)  # not read until the barrier aligns
            self._release_if_aligned()
        else:
            raise ProtocolError(f"{where}: producer sent kind {kind!r}; expected data, end, "
                                "error or barrier")

    async def _return_credits(self, sock: Any) -> None:
        if sock in self._open:
            await sock.send_multipart([CREDIT, str(self._owed[sock]).encode()])
        self._owed[sock] = 0

    def _release_if_aligned(self) -> None:
        if not self._held or not set(self._held) >= set(self._open):
            return
        steps = set(self._held.values())
        if len(steps) != 1:
            raise ProtocolError(f"input {self.name!r}: misaligned barriers {sorted(steps)}")
        for sock in self._held:
            if sock in self._open:
                self.poller.register(sock, zmq.POLLIN)
        self._held.clear()
        self._ready.append(Barrier(steps.pop()))

    def close(self) -> None:
        for e in self.edges:
            e.close()


class OutputPort:
    """One named output, sending to each of its edges."""

    def __init__(self, ctx: zmq.asyncio.Context, name: str, edges: list[tuple[EdgeSpec, int]],
                 producer_id: str, recorders: dict[str, Any] | None = None):
        """``edges``: (spec, index of this producer among the edge's endpoints)."""
        self.name, self.producer_id = name, producer_id
        self.ended = False  # a stage may end a port before its run() returns
        self.edges = [OutputEdge(ctx, s, i, producer_id) for s, i in edges]
        self.recorders = recorders or {}
        self.buffers = SendBuffers()

    async def wait_ready(self) -> None:
        for e in self.edges:
            await e.wait_ready()

    async def send(self, batch: pa.RecordBatch) -> None:
        """Send ``batch`` on every edge, recording it where asked.

        Raises:
            ValueError: the batch's columns differ from the port's schema.
        """
        if not self.edges:
            return
        batch = conform(batch, self.edges[0].spec.schema, f"output {self.producer_id}.{self.name}")
        for e in self.edges:
            if e.spec.name in self.recorders:
                self.recorders[e.spec.name].write(batch)
        # encoded once for all non-keyed edges; a broadcast edge keeps it, so no reuse
        reuse = all(e.spec.kind != "broadcast" for e in self.edges)
        shared = None
        if any(e.spec.kind != "keyed" for e in self.edges):
            shared = encode_batch(batch, self.buffers if reuse else None)
        trackers = []
        for e in self.edges:
            trackers += await e.send_data(batch, shared, self.buffers)
        if shared is not None and reuse:
            self.buffers.hold(shared.parent, trackers)

    async def send_barrier(self, step: int) -> None:
        """Send barrier ``step`` on every edge but broadcast ones (latest values, not a cut)."""
        for e in self.edges:
            if e.spec.kind != "broadcast":
                await e.send_control(BARRIER, json.dumps({"step": step}).encode())

    async def send_end(self) -> None:
        if self.ended:
            return
        self.ended = True
        for e in self.edges:
            await e.send_control(END, self.producer_id.encode())

    async def wait_delivered(self) -> None:
        """After `send_end`: wait until every consumer has read the end."""
        for e in self.edges:
            await e.wait_acked()

    async def send_error(self, stage: str, error: str) -> None:
        for e in self.edges:
            await e.send_control(ERROR, json.dumps({"stage": stage, "error": error}).encode())

    def close(self) -> None:
        for r in self.recorders.values():
            r.close()
        for e in self.edges:
            e.close()
