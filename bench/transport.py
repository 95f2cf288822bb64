"""Arrow record batches over a Molt edge vs raw ZeroMQ, two processes, ipc://.

For each size (1, 16, 64 MiB) a producer process sends ``count`` messages and a
consumer process receives them; throughput = bytes / seconds at the consumer from
the first to the last message. The baseline is raw ZeroMQ PUSH/PULL sending the
same number of bytes with ``copy=False``; the Molt edge sends a record batch with
one int64 column of that size (ROUTER/DEALER with credits, Arrow IPC encoding,
zero-copy decode and schema check). Target: ratio >= 0.8 at 16 MiB.

``--tcp``: the Molt edge over ``tcp://`` loopback with CURVE (molt.runtime.curve, per-run keys,
the ZAP handler admitting the run's client key) versus the same edge in plaintext;
ends with ``ratio transport_curve_16MiB ...``.

Run: ``python bench/transport.py [--count N] [--tcp]``.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import tempfile
import time

import numpy as np
import pyarrow as pa
import zmq
import zmq.asyncio

from molt.runtime.ports import InputPort, OutputPort
from molt.runtime.edges import EdgeSpec

MiB = 1 << 20
SCHEMA = pa.schema([("x", pa.int64())])


def _spec(endpoint: str, curve: str | None = None) -> EdgeSpec:
    return EdgeSpec("bench.out->sink.in", "stream", (endpoint,), ("sink.0",), SCHEMA, capacity=4, curve=curve)


def raw_send(endpoint: str, size: int, count: int) -> None:
    sock = zmq.Context().socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, 4)
    sock.bind(endpoint)
    payload = np.ones(size, dtype=np.uint8).tobytes()
    for _ in range(count + 1):  # one warm-up message
        sock.send(payload, copy=False)
    sock.close(linger=-1)


def raw_recv(endpoint: str, count: int, out: mp.Queue) -> None:
    sock = zmq.Context().socket(zmq.PULL)
    sock.setsockopt(zmq.RCVHWM, 4)
    sock.connect(endpoint)
    sock.recv(copy=False)
    start, total = time.perf_counter(), 0
    for _ in range(count):
        total += len(sock.recv(copy=False).buffer)
    out.put((total, time.perf_counter() - start))


def edge_send(endpoint: str, size: int, count: int, curve: str | None = None) -> None:
    async def main() -> None:
        from molt.runtime.curve import run_keys, start_authenticator

        ctx = zmq.asyncio.Context()
        auth = start_authenticator(ctx, run_keys(curve)) if curve else None
        port = OutputPort(ctx, "out", [(_spec(endpoint, curve), 0)], "bench.0")
        await port.wait_ready()
        batch = pa.RecordBatch.from_arrays([pa.array(np.arange(size // 8, dtype=np.int64))], schema=SCHEMA)
        for _ in range(count + 1):
            await port.send(batch)
        await port.send_end()
        await port.wait_delivered()
        port.close()
        if auth is not None:
            auth.stop()
        ctx.term()

    asyncio.run(main())


def edge_recv(endpoint: str, count: int, out: mp.Queue, curve: str | None = None) -> None:
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port = InputPort(ctx, "in", [_spec(endpoint, curve)], "sink.0")
        await port.start()
        await port.recv()
        start, total = time.perf_counter(), 0
        for _ in range(count):
            batch = await port.recv()
            total += batch.column(0).buffers()[1].size
        out.put((total, time.perf_counter() - start))
        while await port.recv() is not None:
            pass
        port.close()
        ctx.term()

    asyncio.run(main())


def measure(send, recv, size: int, count: int, tcp: bool = False, curve: str | None = None) -> float:
    """GB/s (1e9 bytes per second) seen by the consumer; ``tcp``: over loopback, ``curve``: with
    that keys file."""
    ctx = mp.get_context("spawn")
    endpoint = f"tcp://127.0.0.1:{_free_port()}" if tcp else f"ipc://{tempfile.mkdtemp()}/bench"
    q = ctx.Queue()
    extra = (curve,) if tcp else ()
    procs = [ctx.Process(target=send, args=(endpoint, size, count, *extra)),
             ctx.Process(target=recv, args=(endpoint, count, q, *extra))]
    for p in procs:
        p.start()
    total, seconds = q.get(timeout=600)
    for p in procs:
        p.join(timeout=60)
    return total / seconds / 1e9


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def curve_vs_plain(count_arg: int) -> None:
    """The Molt edge over tcp:// loopback: CURVE (per-run keys) versus plaintext."""
    from pathlib import Path

    from molt.runtime.curve import CurveKeys

    keys = Path(tempfile.mkdtemp()) / "curve.json"
    CurveKeys.generate().write(keys)
    print(f"{'size':>8} {'plain GB/s':>11} {'CURVE GB/s':>11} {'ratio':>6}")
    for mib in (1, 16, 64):
        count = count_arg or max(16, 1024 // mib)
        plain = max(measure(edge_send, edge_recv, mib * MiB, count, tcp=True) for _ in range(3))
        curve = max(measure(edge_send, edge_recv, mib * MiB, count, tcp=True, curve=str(keys)) for _ in range(3))
        print(f"{mib:>5}MiB {plain:>11.3f} {curve:>11.3f} {curve / plain:>6.2f}")
        if mib == 16:
            line = (f"ratio transport_curve_16MiB {curve / plain:.2f} (molt CURVE {curve:.3f} GB/s / baseline "
                    f"plaintext {plain:.3f} GB/s)")
    print(line)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--count", type=int, default=0, help="messages per size (default: 1 GiB worth, >= 16)")
    ap.add_argument("--tcp", action="store_true", help="CURVE versus plaintext over tcp:// loopback")
    args = ap.parse_args()
    if args.tcp:
        return curve_vs_plain(args.count)
    ratio16 = raw16 = molt16 = 0.0
    print(f"{'size':>8} {'raw GB/s':>9} {'molt GB/s':>10} {'ratio':>6}")
    for mib in (1, 16, 64):
        count = args.count or max(16, 1024 // mib)
        raw = max(measure(raw_send, raw_recv, mib * MiB, count) for _ in range(3))
        molt = max(measure(edge_send, edge_recv, mib * MiB, count) for _ in range(3))
        print(f"{mib:>5}MiB {raw:>9.2f} {molt:>10.2f} {molt / raw:>6.2f}")
        if mib == 16:
            ratio16, raw16, molt16 = molt / raw, raw, molt
    print(f"ratio transport_16MiB {ratio16:.2f} (molt {molt16:.2f} GB/s / baseline {raw16:.2f} GB/s)")


if __name__ == "__main__":
    main()
