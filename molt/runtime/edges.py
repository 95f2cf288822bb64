"""ZeroMQ edges carrying Arrow record batches; nothing is pickled.

Every message is two frames, ``[kind, payload]``. Producer to consumer: ``D`` data (one batch as
an Arrow IPC stream), ``E`` end (producer id), ``X`` error (JSON ``{"stage", "error"}``), ``B``
barrier (JSON ``{"step"}``). Consumer to producer: ``H`` hello (JSON ``{"consumer", "credits"}``),
``C`` credit (ASCII count), ``A`` end ack (empty).

Producers bind ROUTERs, consumers connect DEALERs. Data goes to a consumer only against its
credits: ``stream`` edges pick the one with the most, ``keyed`` edges the one at ``crc32(key) %
num_consumers``; ``broadcast`` edges send all to every consumer, without credits. A producer
waits for the end acks before closing: a TCP socket closed with unread input drops what is sent.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import zmq
import zmq.asyncio

from molt.runtime.curve import make_client, make_server, run_keys
from molt.schema import schema_diff

DATA, END, ERROR, BARRIER, HELLO, CREDIT, END_ACK = b"D", b"E", b"X", b"B", b"H", b"C", b"A"
_KINDS = {DATA, END, ERROR, BARRIER, HELLO, CREDIT, END_ACK}
logger = logging.getLogger(__name__)
END_ACK_TIMEOUT_S = 30.0  # also a stream edge's linger
EdgeKind = Literal["stream", "keyed", "broadcast"]


class ProtocolError(Exception):
    """A malformed or unexpected message on an edge."""


class ConsumerGoneError(ProtocolError):
    """A consumer has gone: a consequence of another stage's failure."""


class UpstreamError(RuntimeError):
    """A producer stage failed and sent an error frame downstream."""

    def __init__(self, stage: str, error: str) -> None:
        super().__init__(f"upstream stage {stage!r} failed:\n{error}")
        self.stage = stage


@dataclass(frozen=True)
class Barrier:
    """A checkpoint barrier, travelling in-band with the data."""

    step: int


@dataclass(frozen=True)
class EdgeSpec:
    """One edge as both of its ends see it; ``curve``: the CURVE keys file (None: plaintext)."""

    name: str
    kind: EdgeKind
    endpoints: tuple[str, ...]
    consumers: tuple[str, ...]
    schema: pa.Schema
    key: str = "prompt_id"
    capacity: int = 4
    hwm: int = 64
    ready_timeout_s: float = 120.0
    curve: str | None = None
    max_message_bytes: int = 1 << 30


class SendBuffers:
    """Send buffers, reused once the ZeroMQ trackers of their sends are done (fresh memory
    costs page faults that make encoding several times slower)."""

    def __init__(self, max_buffers: int = 16) -> None:
        self.max_buffers = max_buffers
        self._held: list[tuple[pa.Buffer, list[zmq.MessageTracker]]] = []

    def allocate(self, size: int) -> pa.Buffer:
        for i, (buf, trackers) in enumerate(self._held):
            if buf.size >= size and all(t.done for t in trackers):
                del self._held[i]
                return buf
        return pa.allocate_buffer(size + size // 8)  # the next batch may be a bit larger

    def hold(self, buf: pa.Buffer, trackers: list[zmq.MessageTracker]) -> None:
        self._held.append((buf, trackers))
        if len(self._held) > self.max_buffers:
            del self._held[0]  # freed once ZeroMQ is done with it


def encode_batch(batch: pa.RecordBatch, buffers: SendBuffers | None = None) -> pa.Buffer:
    """One batch as an Arrow IPC stream; with ``buffers``, a slice of a pooled buffer."""
    size = batch.schema.serialize().size + pa.ipc.get_record_batch_size(batch) + 64
    buf = buffers.allocate(size) if buffers is not None else pa.allocate_buffer(size)
    sink = pa.FixedSizeBufferWriter(buf)
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    return buf.slice(0, sink.tell())


def decode_batch(payload: Any, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """One batch from IPC bytes, without copying, fully validated.

    Raises:
        ProtocolError: undecodable bytes, or a schema other than ``schema``.
    """
    try:
        reader = pa.ipc.open_stream(pa.py_buffer(payload))
        batch = reader.read_next_batch()
        batch.validate(full=True)  # offsets, UTF-8 against the buffers: a lie could crash a reader
        diff = schema_diff(schema, batch.schema)  # names that are not UTF-8 raise here
    except (pa.ArrowException, StopIteration, OSError, ValueError) as e:
        raise ProtocolError(
            f"{where}: undecodable Arrow payload ({len(payload)} bytes): {e}") from None
    if diff:
        raise ProtocolError(f"{where}: batch schema differs from the edge's: {diff}")
    return batch


def control_payload(payload: Any, field: str, where: str) -> Any:
    """``field`` of a JSON control payload.

    Raises:
        ProtocolError: not UTF-8 JSON, or without ``field`` (naming ``where``).
    """
    try:
        return json.loads(bytes(payload))[field]
    except (ValueError, KeyError, TypeError) as e:  # JSON and UTF-8 errors are ValueErrors
        raise ProtocolError(f"{where}: malformed control payload ({type(e).__name__}: {e}): "
                            f"{bytes(payload)[:80]!r}") from None


def split_frames(frames: list[Any], where: str, max_bytes: int | None = None) -> tuple[bytes, Any]:
    """Split a message into (kind, payload buffer).

    Raises:
        ProtocolError: wrong frame count, unknown kind byte, or a payload over ``max_bytes``.
    """
    if len(frames) != 2:
        raise ProtocolError(f"{where}: expected 2 frames [kind, payload], got {len(frames)}")
    kind, payload = (getattr(f, "buffer", f) for f in frames)  # zmq.Frame or bytes
    if (kind := bytes(kind)) not in _KINDS:
        raise ProtocolError(f"{where}: unknown message kind {kind!r}; expected one of "
                            f"{sorted(k.decode() for k in _KINDS)}")
    if max_bytes is not None and len(payload) > max_bytes:
        raise ProtocolError(f"{where}: a message of {len(payload)} bytes, over the edge's limit of "
                            f"{max_bytes} (edges[].max_message_mib)")
    return kind, payload


def keyed_split(batch: pa.RecordBatch, key: str, num_consumers: int) -> dict[int, pa.RecordBatch]:
    """Split rows by ``crc32(str(key)) % num_consumers`` (stable across processes)."""
    if key not in batch.schema.names:
        raise ValueError(f"keyed edge: key column {key!r} is not in the batch; "
                         f"got columns {batch.schema.names}")
    targets = [zlib.crc32(str(k).encode()) % num_consumers for k in batch.column(key).to_pylist()]
    out = {}
    for j in sorted(set(targets)):
        out[j] = batch.take(pa.array([i for i, t in enumerate(targets) if t == j], pa.int64()))
    return out


class OutputEdge:
    """A producer replica's end of one edge: a bound ROUTER."""

    def __init__(self, ctx: zmq.asyncio.Context, spec: EdgeSpec, replica: int, producer_id: str):
        self.spec, self.producer_id = spec, producer_id
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self.sock.setsockopt(zmq.SNDHWM, spec.hwm)
        self.sock.setsockopt(zmq.RCVHWM, spec.hwm)
        # broadcast: long enough to flush the end to live subscribers, short for departed ones
        linger_s = 5.0 if spec.kind == "broadcast" else END_ACK_TIMEOUT_S
        self.sock.setsockopt(zmq.LINGER, int(linger_s * 1000))
        endpoint = spec.endpoints[replica]
        if spec.curve is not None:
            make_server(self.sock, run_keys(spec.curve))
        if endpoint.startswith("ipc://"):
            Path(endpoint[len("ipc://"):]).parent.mkdir(parents=True, exist_ok=True)
        self.sock.bind(endpoint)
        self.credits: dict[str, int] = {}
        self.acked: set[str] = set()  # consumers that have read this producer's end
        self.strangers: set[str] = set()  # non-consumers that sent something (warned of once)
        self.latest: list[Any] | None = None
        self._rr = 0
        self._responder: asyncio.Task[None] | None = None

    @property
    def where(self) -> str:
        return f"edge {self.spec.name} (producer {self.producer_id})"

    async def wait_ready(self) -> None:
        """Wait for a hello from every consumer (broadcast edges do not wait).

        Raises:
            TimeoutError: naming the consumers that never said hello.
        """
        if self.spec.kind == "broadcast":
            # the socket's only reader: answers hellos (with the latest value) meanwhile
            name = f"{self.spec.name}_hello_loop"
            self._responder = asyncio.create_task(self._serve_hellos(), name=name)
            return
        if not await self._pump_until(lambda: len(self.credits) >= len(self.spec.consumers),
                                      self.spec.ready_timeout_s):
            missing = [c for c in self.spec.consumers if c not in self.credits]
            raise TimeoutError(f"{self.where}: no hello from consumer(s) {missing} after "
                               f"{self.spec.ready_timeout_s:.0f} s")

    async def _serve_hellos(self) -> None:
        while True:
            await self._pump(timeout_ms=1000)

    async def _pump_until(self, done: Callable[[], bool], timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not done():
            if (left := deadline - time.monotonic()) <= 0:
                return False
            await self._pump(timeout_ms=int(min(left, 1.0) * 1000) + 1)
        return True

    async def _pump(self, timeout_ms: int) -> None:
        """Read what consumers sent, waiting up to ``timeout_ms`` for it."""
        if not await self.sock.poll(timeout_ms):
            return
        while await self.sock.poll(0):
            ident, kind_frame, payload = await self._recv3()
            peer = ident.decode(errors="replace")
            if peer not in self.spec.consumers:  # never served, never fatal
                if peer not in self.strangers:
                    self.strangers.add(peer)
                    logger.warning("%s: ignoring messages from %r, which is not a consumer of this "
                                   "edge", self.where, peer)
                continue
            if kind_frame == HELLO:
                credits = control_payload(payload, "credits", f"{self.where}: hello of {peer!r}")
                if not isinstance(credits, int) or isinstance(credits, bool) or credits < 0:
                    raise ProtocolError(
                        f"{self.where}: hello of {peer!r}: credits {credits!r} is not a count")
                self.credits[peer] = credits
                if self.spec.kind == "broadcast" and self.latest is not None:
                    await self.sock.send_multipart([ident, *self.latest], copy=False)
            elif kind_frame == CREDIT:
                if not bytes(payload).isdigit():
                    raise ProtocolError(
                        f"{self.where}: consumer {peer!r} sent credit {bytes(payload)[:20]!r}")
                self.credits[peer] = self.credits.get(peer, 0) + int(bytes(payload))
            elif kind_frame == END_ACK:
                self.acked.add(peer)
            else:
                raise ProtocolError(f"{self.where}: consumer {peer!r} sent kind {kind_frame!r}; "
                                    "expected hello, credit or end ack")

    async def wait_acked(self, timeout_s: float = END_ACK_TIMEOUT_S) -> bool:
        """Wait at most ``timeout_s`` for every consumer's end ack; True when all came."""
        return (self.spec.kind == "broadcast"
                or await self._pump_until(lambda: self.acked >= set(self.spec.consumers),
                                          timeout_s))

    async def _recv3(self) -> tuple[bytes, bytes, Any]:
        """[identity, kind, payload]; kind b"?" for another shape or a payload over 4 KiB."""
        frames = await self.sock.recv_multipart(copy=False)
        if len(frames) != 3 or len(frames[2]) > 4096:
            return frames[0].bytes, b"?", b""
        return frames[0].bytes, frames[1].bytes, frames[2].buffer

    async def _take_credit(self, consumer: str | None) -> str:
        """Spend a credit of ``consumer`` (None: of the one with the most), once there is one."""
        while True:
            if consumer is None:
                ready = [c for c in self.spec.consumers if self.credits.get(c, 0) > 0]
                if ready:
                    best = max(self.credits[c] for c in ready)
                    ready = [c for c in ready if self.credits[c] == best]
                    self._rr += 1
                    choice = ready[self._rr % len(ready)]
                    self.credits[choice] -= 1
                    return choice
            elif self.credits.get(consumer, 0) > 0:
                self.credits[consumer] -= 1
                return consumer
            await self._pump(timeout_ms=1000)

    async def send_data(self, batch: pa.RecordBatch, payload: pa.Buffer | None,
                        buffers: SendBuffers | None = None) -> list[zmq.MessageTracker]:
        """Send a batch (``payload``: its encoding); returns the trackers of its sends."""
        if self.spec.kind == "keyed":
            for j, part in keyed_split(batch, self.spec.key, len(self.spec.consumers)).items():
                peer = await self._take_credit(self.spec.consumers[j])
                encoded = encode_batch(part, buffers)
                tracker = await self._send(peer, DATA, encoded, track=buffers is not None)
                if buffers is not None and tracker is not None:
                    buffers.hold(encoded.parent, [tracker])
            return []
        payload = payload if payload is not None else encode_batch(batch)
        if self.spec.kind == "broadcast":
            self.latest = [DATA, payload]
            for peer in list(self.credits):
                await self._send(peer, DATA, payload)
            return []
        peer = await self._take_credit(None)
        tracker = await self._send(peer, DATA, payload, track=True)
        return [tracker] if tracker is not None else []

    async def send_control(self, kind: bytes, payload: bytes) -> None:
        """Send an end, error or barrier to every consumer, without credit."""
        if self.spec.kind == "broadcast" and kind in (END, ERROR):
            self.latest = [kind, payload]  # a late subscriber learns the stream ended
        else:
            await self._pump(timeout_ms=0)
        for peer in list(self.credits):
            await self._send(peer, kind, payload)

    async def _send(self, peer: str, kind: bytes, payload: Any,
                    track: bool = False) -> zmq.MessageTracker | None:
        try:
            return await self.sock.send_multipart([peer.encode(), kind, payload], copy=False,
                                                   track=track)
        except zmq.error.ZMQError as e:
            if self.spec.kind != "broadcast":
                raise ConsumerGoneError(
                    f"{self.where}: cannot reach consumer {peer!r}: {e}") from None
            self.credits.pop(peer, None)  # a subscriber that left
            return None

    def close(self) -> None:
        if self._responder is not None:
            self._responder.cancel()
        self.sock.close()


class InputEdge:
    """A consumer replica's end of one edge: one DEALER per producer replica."""

    def __init__(self, ctx: zmq.asyncio.Context, spec: EdgeSpec, consumer_id: str):
        self.spec, self.consumer_id = spec, consumer_id
        self.socks = []
        for endpoint in spec.endpoints:
            s = ctx.socket(zmq.DEALER)
            s.setsockopt(zmq.IDENTITY, consumer_id.encode())
            s.setsockopt(zmq.RCVHWM, spec.hwm)
            s.setsockopt(zmq.SNDHWM, spec.hwm)
            s.setsockopt(zmq.LINGER, 0)  # a failing consumer owes nothing; ports: 1 s after end ack
            if spec.curve is not None:
                make_client(s, run_keys(spec.curve))
            s.connect(endpoint)
            self.socks.append(s)

    async def hello(self) -> None:
        msg = json.dumps({"consumer": self.consumer_id, "credits": self.spec.capacity}).encode()
        for s in self.socks:
            await s.send_multipart([HELLO, msg])

    def close(self) -> None:
        for s in self.socks:
            s.close()
