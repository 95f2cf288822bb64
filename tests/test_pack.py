"""Pack stage and step planning: whole groups per step, never-split rows, balanced ranks."""

import asyncio

import pyarrow as pa
import pytest

from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import StageContext
from molt.train.packing import balance_ranks, fill_micro_batches, pack_sequences, plan_step
from stages.pack import Pack, split_groups

COLS = ("sample_id", "prompt_id", "rollout_id", "token_ids", "loss_mask", "rollout_logprobs",
        "policy_version", "advantages", "reward")
SCHEMA = make_schema(resolve_fields(COLS, "test"), "trajectory")


def rows_of(prompt_id, lengths, generated=2, version=0, adv=1.0):
    """One group: a row per length; the last `generated` tokens are generated."""
    out = []
    for k, n in enumerate(lengths):
        g = min(generated, n - 1)
        mask = [False] * (n - g) + [True] * g
        out.append({"sample_id": f"{prompt_id}/{k}", "prompt_id": prompt_id, "rollout_id": f"{prompt_id}/{k}",
                    "token_ids": [(7 * k + i) % 50 + 3 for i in range(n)], "loss_mask": mask,
                    "rollout_logprobs": [-1.0 if m else 0.0 for m in mask],
                    "policy_version": [version if m else -1 for m in mask],
                    "advantages": [(adv if k % 2 == 0 else -adv) if m else 0.0 for m in mask], "reward": float(k % 2)})
    return out


def group(prompt_id, lengths, **kw):
    return batch_from_rows(rows_of(prompt_id, lengths, **kw), SCHEMA)


def test_plan_balances_tokens_and_gives_every_rank_the_same_micro_batch_count():
    plan = plan_step([5, 4, 3, 2], world_size=2, max_tokens=6)
    assert plan.dp_rank == [0, 1, 1, 0] and plan.micro_batch == [0, 0, 1, 1] and plan.num_micro_batches == 2
    assert fill_micro_batches([3, 5, 2, 4], 6) == [2, 0, 1, 1]
    assert balance_ranks([9, 1, 1, 1], 2) == [0, 1, 1, 1]
    uneven = plan_step([9, 1, 1], world_size=2, max_tokens=4)
    assert uneven.num_micro_batches == 1 and uneven.dp_rank == [0, 1, 1]


def test_pack_never_splits_a_sample_and_positions_restart():
    packed = pack_sequences([[7, 8, 9], [4, 5]])
    assert packed.input_ids.tolist() == [[7, 8, 9, 4, 5]]
    assert packed.position_ids.tolist() == [[0, 1, 2, 0, 1]] and packed.starts == [0, 3]
    lengths = [11, 3, 7, 20, 5, 5, 9]
    plan = plan_step(lengths, world_size=2, max_tokens=16)
    for rank in range(2):
        for k in range(plan.num_micro_batches):
            rows = [i for i in range(len(lengths)) if plan.dp_rank[i] == rank and plan.micro_batch[i] == k]
            assert sum(lengths[i] for i in rows) <= 16 or len(rows) == 1, "over budget only when alone"
    with pytest.raises(ValueError, match="token_ids"):
        pack_sequences([[1], []])


def test_rows_sharing_a_prompt_are_placed_together_and_their_prompt_counted_once():
    prompt = [11] * 10
    rows = [{"sample_id": f"{g}/{k}", "prompt_id": g, "token_ids": prompt[:-1] + [int(g == "a"), k, k + 1],
             "loss_mask": [False] * 10 + [True, True], "advantages": [0.0] * 10 + [1.0, 1.0]}
            for g in ("a", "b") for k in range(4)]
    pack = Pack(Pack.Config(groups_per_step=2, max_tokens_per_micro_batch=20), StageContext("pack"))
    pack.setup()
    out = pack.place(split_groups(pa.RecordBatch.from_pylist(rows)))
    micro = dict(zip(out.column("sample_id").to_pylist(), out.column("micro_batch").to_pylist()))
    assert len({micro[f"a/{k}"] for k in range(4)}) == 1 and len({micro[f"b/{k}"] for k in range(4)}) == 1
    assert micro["a/0"] != micro["b/0"], "10 + 4 x 2 = 18 tokens per group: one group per budget of 20"


def test_split_groups_keeps_first_appearance_order():
    batch = batch_from_rows(rows_of("a", [3, 3]) + rows_of("b", [3]) + rows_of("a", [4]), SCHEMA)
    parts = split_groups(batch)
    assert [p.column("prompt_id").to_pylist() for p in parts] == [["a", "a", "a"], ["b"]]


def run_pack(batches, **config):
    stage = Pack(Pack.Config(**config), StageContext("pack"))
    stage.setup()
    out = []

    async def fake_recv(port="in", timeout_s=None):
        return batches.pop(0) if batches else None

    async def fake_send(port, batch):
        out.append(batch)

    stage.recv, stage.send = fake_recv, fake_send  # the loop under test, without sockets
    asyncio.run(stage.run())
    return stage, out


def test_pack_emits_one_batch_per_step_with_global_denominators_and_drops_a_partial_step():
    batches = [group("a", [6, 4]), pa.Table.from_batches([group("b", [5, 5]), group("c", [3, 3])]).combine_chunks().to_batches()[0],
               group("d", [8, 1]), group("e", [4])]
    stage, out = run_pack(batches, groups_per_step=2, world_size=2, max_tokens_per_micro_batch=10)
    assert len(out) == 2 and stage.metrics.counters["groups_dropped"] == 1
    first, second = (b.to_pylist() for b in out)
    assert {r["prompt_id"] for r in first} == {"a", "b"} and {r["prompt_id"] for r in second} == {"c", "d"}
    assert {r["step"] for r in first} == {0} and {r["step"] for r in second} == {1}
    assert {r["step_loss_tokens"] for r in first} == {8}
    # the 1-token row of group d has an all-false loss mask: trained, but not a seq in the denominator
    assert {r["step_loss_tokens"] for r in second} == {6} and {r["step_loss_seqs"] for r in second} == {3}
    keys = [(r["dp_rank"], r["micro_batch"]) for r in first]
    assert keys == sorted(keys) and {r for r, _ in keys} == {0, 1}
    assert sorted(r["sample_id"] for b in out for r in b.to_pylist()) == sorted(
        ["a/0", "a/1", "b/0", "b/1", "c/0", "c/1", "d/0", "d/1"])


def test_pack_can_flush_a_partial_step_at_end_of_stream():
    _, out = run_pack([group("a", [3]), group("b", [3]), group("c", [3])], groups_per_step=2, flush_partial=True)
    assert [b.num_rows for b in out] == [2, 1] and out[1].column("step").to_pylist() == [1]
