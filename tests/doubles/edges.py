"""Edge ends in their own processes (multiprocessing spawn targets): a producer that exits
right after its last batch and its end, and a consumer that reports what arrived."""

from __future__ import annotations

import asyncio
from typing import Any

import numpy as np
import pyarrow as pa
import zmq.asyncio

from molt.runtime.ports import InputPort, OutputPort
from molt.runtime.edges import EdgeSpec

SCHEMA = pa.schema([("x", pa.int64())])


def edge(endpoint: str) -> EdgeSpec:
    return EdgeSpec("p.out->c.in", "stream", (endpoint,), ("c.0",), SCHEMA, capacity=4)


def produce(endpoint: str, num_bytes: int, count: int) -> None:
    """Send ``count`` batches of ``num_bytes`` and the end, as a stage's lifecycle does, then exit."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port = OutputPort(ctx, "out", [(edge(endpoint), 0)], "p.0")
        await port.wait_ready()
        batch = pa.RecordBatch.from_arrays([pa.array(np.arange(num_bytes // 8, dtype=np.int64))], schema=SCHEMA)
        for _ in range(count):
            await port.send(batch)
        await port.send_end()
        await port.wait_delivered()
        port.close()
        ctx.term()

    asyncio.run(main())


def consume(endpoint: str, out: Any) -> None:
    """Put (batches received, True once the end arrived) on ``out``; (n, False) if it stalls 20 s."""
    async def main() -> None:
        ctx = zmq.asyncio.Context()
        port = InputPort(ctx, "in", [edge(endpoint)], "c.0")
        await port.start()
        received, ended = 0, False
        try:
            while await port.recv(timeout_s=20) is not None:
                received += 1
            ended = True
        except TimeoutError:
            pass
        out.put((received, ended))
        port.close()
        ctx.term()

    asyncio.run(main())
