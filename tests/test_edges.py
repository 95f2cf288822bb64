"""Edges over real loopback sockets (ipc:// in a temp dir, and inproc://)."""

import asyncio
import sys
import subprocess
import ast
import dataclasses
import json

import pyarrow as pa
import pytest
import zmq
import zmq.asyncio

from molt.runtime.ports import InputPort, OutputPort
from molt.runtime.edges import DATA, Barrier, EdgeSpec, ProtocolError, UpstreamError, encode_batch, keyed_split

SCHEMA = pa.schema([("prompt_id", pa.string()), ("x", pa.int64())])


def batch(ids, xs=None):
    return pa.RecordBatch.from_pydict({"prompt_id": ids, "x": xs or list(range(len(ids)))}, schema=SCHEMA)


def spec(tmp_path, kind="stream", producers=1, consumers=1, capacity=4, timeout=5.0):
    return EdgeSpec("p.out->c.in", kind, tuple(f"ipc://{tmp_path}/e.{i}" for i in range(producers)),
                    tuple(f"c.{j}" for j in range(consumers)), SCHEMA, "prompt_id", capacity, 64, timeout)


@pytest.fixture
def zctx():
    ctx = zmq.asyncio.Context()
    yield ctx
    ctx.destroy(linger=0)


async def connected(ctx, s):
    """One producer and one consumer of edge ``s``, past their hello handshake."""
    out = OutputPort(ctx, "out", [(s, 0)], "p.0")
    inp = InputPort(ctx, "in", [s], "c.0")
    await inp.start()
    await out.wait_ready()
    return out, inp


async def _drain(port):
    items = []
    while (item := await port.recv(timeout_s=5)) is not None:
        items.append(item)
    return items


def test_stream_edge_delivers_every_row_once_across_two_consumers(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path, consumers=2)
        out = OutputPort(ctx, "out", [(s, 0)], "p.0")
        ins = [InputPort(ctx, "in", [s], f"c.{j}") for j in range(2)]
        for i in ins:
            await i.start()
        await out.wait_ready()
        consumers = asyncio.gather(*(_drain(i) for i in ins))
        for k in range(20):
            await out.send(batch([f"g{k}"], [k]))
        await out.send_end()
        got = await consumers
        for p in [out, *ins]:
            p.close()
        return got

    got = asyncio.run(main())
    xs = sorted(x for items in got for b in items for x in b.column("x").to_pylist())
    assert xs == list(range(20))
    assert all(len(items) > 0 for items in got), "both consumers get work"


def test_keyed_edge_never_splits_a_group_across_replicas(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path, kind="keyed", consumers=3)
        out = OutputPort(ctx, "out", [(s, 0)], "p.0")
        ins = [InputPort(ctx, "in", [s], f"c.{j}") for j in range(3)]
        for i in ins:
            await i.start()
        await out.wait_ready()
        ids = [f"g{k % 7}" for k in range(70)]
        consumers = asyncio.gather(*(_drain(i) for i in ins))
        for start in range(0, 70, 10):
            await out.send(batch(ids[start:start + 10], list(range(start, start + 10))))
        await out.send_end()
        got = await consumers
        out.close(), [i.close() for i in ins]
        return got

    got = asyncio.run(main())
    owner = {}
    for j, items in enumerate(got):
        for b in items:
            for pid in b.column("prompt_id").to_pylist():
                assert owner.setdefault(pid, j) == j, f"group {pid} split across replicas"
    assert len(owner) == 7 and sum(b.num_rows for items in got for b in items) == 70


def test_keyed_split_is_stable_and_complete():
    b = batch([f"g{k}" for k in range(10)])
    parts = keyed_split(b, "prompt_id", 4)
    assert sorted(x for p in parts.values() for x in p.column("x").to_pylist()) == list(range(10))
    assert keyed_split(b, "prompt_id", 4).keys() == parts.keys()


def test_credits_hold_a_producer_back_until_the_consumer_reads(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path, capacity=2)
        out, inp = await connected(ctx, s)
        await out.send(batch(["a"]))
        await out.send(batch(["b"]))
        blocked = asyncio.create_task(out.send(batch(["c"])))
        await asyncio.sleep(0.5)
        was_blocked = not blocked.done()
        first = await inp.recv(timeout_s=5)  # returns one credit
        await asyncio.wait_for(blocked, 5)
        out.close(), inp.close()
        return was_blocked, first

    was_blocked, first = asyncio.run(main())
    assert was_blocked, "a third batch must wait for a credit when capacity is 2"
    assert first.column("prompt_id").to_pylist() == ["a"]


def test_a_producer_closes_only_after_its_consumer_has_read_the_end(zctx, tmp_path):
    async def main():
        out, inp = await connected(zctx, spec(tmp_path))
        await out.send(batch(["a"]))
        await out.send_end()
        delivered = asyncio.create_task(out.wait_delivered())
        await asyncio.sleep(0.5)
        waited = not delivered.done()
        items = await _drain(inp)
        await asyncio.wait_for(delivered, 5)
        out.close(), inp.close()
        return waited, items

    waited, items = asyncio.run(main())
    assert waited, "the end is not delivered until the consumer has read it"
    assert len(items) == 1


def test_the_wait_for_the_end_ack_is_bounded_when_the_consumer_never_reads(zctx, tmp_path):
    async def main():
        out, inp = await connected(zctx, spec(tmp_path))
        await out.send_end()
        acked = await out.edges[0].wait_acked(timeout_s=0.3)
        out.close(), inp.close()
        return acked

    assert asyncio.run(main()) is False


def test_big_batches_over_tcp_arrive_whole_with_the_end():
    """A producer process exiting right after its last 64 MiB batch and its end: before end acks,
    the consumer's last credits sat unread as the producer's TCP socket closed, the reset dropped
    what was in flight, and the consumer lost the last batch and the end in about half the runs."""
    import multiprocessing as mp

    from tests.doubles.edges import consume, produce

    ctx = mp.get_context("spawn")
    for _ in range(3):
        endpoint, q = free_tcp_endpoint(), ctx.Queue()
        procs = [ctx.Process(target=produce, args=(endpoint, 64 << 20, 6)), ctx.Process(target=consume, args=(endpoint, q))]
        for p in procs:
            p.start()
        got = q.get(timeout=120)
        for p in procs:
            p.join(timeout=30)
        assert got == (6, True), f"received {got[0]} of 6 batches, end {'seen' if got[1] else 'lost'}"
        assert [p.exitcode for p in procs] == [0, 0]


def test_broadcast_gives_a_late_subscriber_the_latest_value(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path, kind="broadcast")
        out = OutputPort(ctx, "out", [(s, 0)], "p.0")
        await out.wait_ready()  # does not wait for subscribers
        await out.send(batch(["v1"]))
        await out.send(batch(["v2"]))
        inp = InputPort(ctx, "in", [s], "c.0")
        await inp.start()
        first = await inp.recv(timeout_s=5)
        await out.send(batch(["v3"]))
        await asyncio.sleep(0.2)
        await inp.drain_nowait()
        newest = inp.latest()
        out.close(), inp.close()
        return first, newest

    first, newest = asyncio.run(main())
    assert first.column("prompt_id").to_pylist() == ["v2"]
    assert newest.column("prompt_id").to_pylist() == ["v3"]


def test_a_producer_names_the_missing_consumer_and_seconds_when_nobody_says_hello(zctx, tmp_path):
    async def main():
        ctx = zctx
        out = OutputPort(ctx, "out", [(spec(tmp_path, consumers=2, timeout=1.0), 0)], "p.0")
        try:
            await out.wait_ready()
        finally:
            out.close()

    with pytest.raises(TimeoutError, match=r"no hello from consumer\(s\) \['c.0', 'c.1'\] after 1 s"):
        asyncio.run(main())


def test_error_frames_raise_upstream_error_with_the_stage_name(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path)
        out, inp = await connected(ctx, s)
        await out.send_error("rollout", "Traceback: ValueError")
        try:
            await inp.recv(timeout_s=5)
        finally:
            out.close(), inp.close()

    with pytest.raises(UpstreamError, match=r"upstream stage 'rollout' failed"):
        asyncio.run(main())


def test_barriers_are_aligned_across_producers(zctx, tmp_path):
    async def main():
        ctx = zctx
        s = spec(tmp_path, producers=2)
        outs = [OutputPort(ctx, "out", [(s, i)], f"p.{i}") for i in range(2)]
        inp = InputPort(ctx, "in", [s], "c.0")
        await inp.start()
        for o in outs:
            await o.wait_ready()
        await outs[0].send(batch(["a"]))
        await outs[0].send_barrier(1)
        await outs[0].send(batch(["after-barrier"]))
        await asyncio.sleep(0.2)
        await outs[1].send(batch(["b"]))
        await outs[1].send_barrier(1)
        for o in outs:
            await o.send_end()
        items = await _drain(inp)
        [o.close() for o in outs], inp.close()
        return items

    items = asyncio.run(main())
    kinds = ["B" if isinstance(i, Barrier) else i.column("prompt_id")[0].as_py() for i in items]
    assert kinds.index("B") > kinds.index("a") and kinds.index("B") > kinds.index("b")
    assert kinds.index("after-barrier") > kinds.index("B")


# Malformed frames: what each must raise on the consumer side.
MALFORMED = [
    ([b"Z", b""], r"unknown message kind b'Z'"),
    ([DATA], r"expected 2 frames \[kind, payload\], got 1"),
    ([DATA, b"\x00\x01garbage"], r"undecodable Arrow payload"),
    ([DATA, None], r"undecodable Arrow payload"),  # truncated: filled in below
    ([DATA, encode_batch(pa.RecordBatch.from_pydict({"y": [1]}))], r"schema differs from the edge's: "
     r"missing columns \['prompt_id', 'x'\]; unexpected columns \['y'\]"),
    ([b"H", b"{}"], r"producer sent kind b'H'"),
    ([b"X", b'{"stage": "\xff"}'], r"malformed control payload \(UnicodeDecodeError"),
    ([b"X", b'{"stage": "s"}'], r"malformed control payload \(KeyError"),
    ([b"B", b"not json"], r"malformed control payload \(JSONDecodeError"),
    ([b"B", b'{"step": "7"}'], r"barrier step '7' is not an integer"),
    ([DATA, b"x" * 2000], r"a message of 2000 bytes, over the edge's limit of 1024"),
]


@pytest.mark.parametrize("frames,error", MALFORMED)
def test_malformed_frames_raise_protocol_errors_naming_the_edge(zctx, tmp_path, frames, error):
    if len(frames) == 2 and frames[1] is None:
        full = encode_batch(batch(["a"])).to_pybytes()
        frames = [DATA, full[: len(full) // 2]]

    async def main():
        ctx = zctx
        s = dataclasses.replace(spec(tmp_path), max_message_bytes=1024)
        router = ctx.socket(zmq.ROUTER)
        router.bind(s.endpoints[0])
        inp = InputPort(ctx, "in", [s], "c.0")
        await inp.start()
        ident, kind, hello = await router.recv_multipart()
        assert kind == b"H" and json.loads(hello)["credits"] == 4
        await router.send_multipart([ident, *frames])
        try:
            await inp.recv(timeout_s=5)
        finally:
            router.close(linger=0), inp.close()

    with pytest.raises(ProtocolError, match=r"edge p.out->c.in .*" + error):
        asyncio.run(main())


FUZZ = """
import random, sys
import pyarrow as pa
from molt.runtime.edges import ProtocolError, decode_batch, encode_batch
schema = pa.schema([("prompt_id", pa.string()), ("token_ids", pa.list_(pa.int32())), ("x", pa.float32())])
good = encode_batch(pa.RecordBatch.from_pydict(
    {"prompt_id": ["a", "bb", "ccc"] * 20, "token_ids": [[1, 2], [], [3, 4, 5]] * 20, "x": [0.5] * 60},
    schema=schema)).to_pybytes()
rng, outcomes = random.Random(int(sys.argv[1])), {"refused": 0, "read": 0}
for _ in range(int(sys.argv[2])):
    data = bytearray(good)
    for _ in range(rng.randint(1, 4)):
        data[rng.randrange(len(data))] = rng.randrange(256)
    try:
        b = decode_batch(bytes(data), schema, "fuzz")
    except ProtocolError:
        outcomes["refused"] += 1
        continue
    b.to_pylist()  # what a stage does with it: every value read
    outcomes["read"] += 1
print(outcomes)
"""


def test_corrupted_batch_buffers_are_refused_or_read_and_never_crash_the_reader():
    # offsets, lengths and UTF-8 that lie about the buffers: without full validation, reading can segfault
    out = subprocess.run([sys.executable, "-c", FUZZ, "0", "3000"], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, f"the reader crashed (exit {out.returncode}): {out.stderr[-2000:]}"
    outcomes = ast.literal_eval(out.stdout.strip())
    assert outcomes["refused"] > 100 and sum(outcomes.values()) == 3000, outcomes


def test_a_producer_ignores_a_stranger_and_names_a_consumer_that_sends_garbage(zctx, tmp_path, caplog):
    async def main():
        s = spec(tmp_path)
        out, inp = await connected(zctx, s)
        stranger = zctx.socket(zmq.DEALER)
        stranger.setsockopt(zmq.IDENTITY, b"intruder")
        stranger.connect(s.endpoints[0])
        for frames in ([b"H", b"\xff"], [b"C", b"-5"], [b"Z"], [b"H", b'{"credits": 99}']):
            await stranger.send_multipart(frames)
        await asyncio.sleep(0.2)
        await out.send(batch(["a", "b"]))
        await out.send_end()
        got = await _drain(inp)
        assert [r["prompt_id"] for b in got for r in b.to_pylist()] == ["a", "b"], "the consumer gets all"
        assert "intruder" not in out.edges[0].credits, "a stranger is never served"
        stranger.close(linger=0), inp.close(), out.close()
        other = dataclasses.replace(s, endpoints=(f"ipc://{tmp_path}/other",))
        producer = OutputPort(zctx, "out", [(other, 0)], "p.0")
        liar = zctx.socket(zmq.DEALER)  # the consumer's identity, with a malformed hello
        liar.setsockopt(zmq.IDENTITY, b"c.0")
        liar.connect(other.endpoints[0])
        await liar.send_multipart([b"H", b"\xff"])
        try:
            await producer.wait_ready()
        finally:
            liar.close(linger=0), producer.close()

    with pytest.raises(ProtocolError, match=r"edge p.out->c.in \(producer p.0\): hello of 'c.0': malformed control "
                                            r"payload \(UnicodeDecodeError"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records].count(
        "edge p.out->c.in (producer p.0): ignoring messages from 'intruder', which is not a consumer of this edge") == 1


def test_received_batches_share_the_message_memory(zctx, tmp_path):
    """Zero-copy receive: the column buffer lies inside the received frame."""
    async def main():
        ctx = zctx
        s = spec(tmp_path)
        out, inp = await connected(ctx, s)
        await out.send(batch(["a"] * 1000, list(range(1000))))
        b = await inp.recv(timeout_s=5)
        out.close(), inp.close()
        return b

    b = asyncio.run(main())
    assert b.column("x").to_pylist() == list(range(1000))
    assert b.column("x").buffers()[1].parent is not None or not b.column("x").buffers()[1].is_mutable


def test_the_in_process_edge_is_the_same_code_over_inproc(zctx):
    async def main():
        s = EdgeSpec("a.out->b.in", "stream", ("inproc://edge-a-b",), ("b.0",), SCHEMA)
        out = OutputPort(zctx, "out", [(s, 0)], "a.0")
        inp = InputPort(zctx, "in", [s], "b.0")
        await inp.start()
        await out.wait_ready()
        consumer = asyncio.create_task(_drain(inp))
        for k in range(10):
            await out.send(batch([f"g{k}"], [k]))
        await out.send_end()
        got = await consumer
        out.close(), inp.close()
        return got

    got = asyncio.run(main())
    assert [x for b in got for x in b.column("x").to_pylist()] == list(range(10))


def free_tcp_endpoint() -> str:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"tcp://127.0.0.1:{s.getsockname()[1]}"


def test_a_curve_edge_delivers_and_a_peer_without_the_run_keys_can_neither_read_nor_inject(zctx, tmp_path):
    """tcp:// with CURVE (molt.runtime.curve): the run's consumer gets the batch; a consumer with other keys,
    or none, is never admitted (its hello never reaches the producer); a producer without the server
    secret cannot deliver a batch to the run's consumer."""
    from molt.runtime.curve import CurveKeys, make_client, run_keys, start_authenticator

    keys_file = tmp_path / "keys" / "curve.json"
    CurveKeys.generate().write(keys_file)
    assert oct(keys_file.stat().st_mode & 0o777) == "0o600"
    keys = run_keys(str(keys_file))
    s = EdgeSpec("p.out->c.in", "stream", (free_tcp_endpoint(),), ("c.0", "evil"), SCHEMA, "prompt_id", 4, 64,
                 1.5, curve=str(keys_file))
    hello = [b"H", json.dumps({"consumer": "evil", "credits": 4}).encode()]

    async def main():
        auth = start_authenticator(zctx, keys)
        try:
            out = OutputPort(zctx, "out", [(s, 0)], "p.0")
            inp = InputPort(zctx, "in", [s], "c.0")
            await inp.start()
            other, plain = zctx.socket(zmq.DEALER), zctx.socket(zmq.DEALER)
            make_client(other, CurveKeys(keys.server_public, keys.server_secret, *(k.decode() for k in
                                                                                   zmq.curve_keypair())))
            for rogue in (other, plain):  # both say hello as consumer "evil"
                rogue.setsockopt(zmq.IDENTITY, b"evil")
                rogue.setsockopt(zmq.LINGER, 0)
                rogue.connect(s.endpoints[0])
                await rogue.send_multipart(hello)
            with pytest.raises(TimeoutError, match=r"no hello from consumer\(s\) \['evil'\]"):
                await out.wait_ready()  # the run's consumer said hello; neither rogue got through
            assert set(out.edges[0].credits) == {"c.0"}
            await out.edges[0].send_data(batch(["g0"], [7]), None, out.buffers)
            got = await inp.recv(timeout_s=5)
            assert got.column("x").to_pylist() == [7]
            for p, r in ((out, other), (inp, plain)):
                p.close(), r.close()
            # a rogue producer on the consumer's endpoint: its own server keys, then none
            for rogue_keys in (CurveKeys.generate(), None):
                endpoint = free_tcp_endpoint()
                rogue = zctx.socket(zmq.ROUTER)
                rogue.setsockopt(zmq.LINGER, 0)
                if rogue_keys is not None:
                    from molt.runtime.curve import make_server
                    make_server(rogue, rogue_keys)
                rogue.bind(endpoint)
                victim = InputPort(zctx, "in", [EdgeSpec("p.out->c.in", "stream", (endpoint,), ("c.0",), SCHEMA,
                                                         curve=str(keys_file))], "c.0")
                await victim.start()
                await asyncio.sleep(0.5)
                with pytest.raises(zmq.ZMQError):  # no such peer: the handshake never completed
                    rogue.setsockopt(zmq.ROUTER_MANDATORY, 1)
                    await rogue.send_multipart([b"c.0", DATA, encode_batch(batch(["x"], [666]))])
                with pytest.raises(TimeoutError):
                    await victim.recv(timeout_s=1.0)
                victim.close(), rogue.close()
        finally:
            auth.stop()

    asyncio.run(main())
