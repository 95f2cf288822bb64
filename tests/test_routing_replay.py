"""Routing replay (R3): the engine's expert choices recorded per token and replayed in training."""

from __future__ import annotations

import asyncio

import numpy as np
import pyarrow as pa
import pytest
import torch

from molt.agents import ChatTemplate, Env, Result, run_episode
from molt.engines.base import Completion, SamplingParams
from molt.schema import batch_from_rows, make_schema, resolve_fields
from tests.test_moe import stage_step, train_stage

COLUMNS = ("sample_id", "prompt_id", "rollout_id", "segment_index", "token_ids", "loss_mask", "rollout_logprobs",
           "policy_version", "group_size", "finish_reason", "metadata", "routed_experts", "advantages", "reward",
           "images", "image_token_positions")


class TwoTurns(Env):
    """Asks twice; the reward is 1 once the second answer arrives."""

    def reset(self, task):
        self.turn = 0
        return [{"role": "user", "content": task["question"]}]

    def step(self, text):
        self.turn += 1
        if self.turn == 2:
            return Result(reward=1.0, terminated=True)
        return Result(reward=0.0, observation="And once more?")


def expert_inputs(model) -> list[torch.Tensor]:
    """Hooks on every experts module: the top-k index tensors [S, k] they are called with, per layer."""
    seen: list[torch.Tensor] = []
    for layer in model.lm.model.layers:
        layer.mlp.experts.register_forward_hook(lambda m, args, out: seen.append(args[1].detach().clone()))
    return seen


@pytest.fixture(scope="module")
def recorded(tiny_moe_distinct):
    """The step batch of two groups of two 2-turn rollouts from the transformers engine recording routing."""
    return episode_batch(tiny_moe_distinct)


def episode_batch(model_dir, seed=0):
    from transformers import AutoTokenizer

    from molt.agents.episode import episode_rows
    from molt.engines.hf import TransformersEngine
    from tests.test_train import step_batch

    engine = TransformersEngine(str(model_dir), record_routing=True)
    chat = ChatTemplate(AutoTokenizer.from_pretrained(model_dir))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=seed)
    groups = []
    for g, question in enumerate(("What is 2 + 3?", "Name a colour.")):
        rows = []
        for k in range(2):
            episode = asyncio.run(run_episode(engine, chat, TwoTurns(), {"question": question}, params,
                                              f"p{g}/{k}", max_turns=2))
            rows += episode_rows(episode, f"p{g}", f"p{g}/{k}", {}, 2, with_score=False)
        for i, row in enumerate(rows):
            row["advantages"] = [(1.0 - 2 * (i % 2)) if m else 0.0 for m in row["loss_mask"]]
            row["reward"] = float(i % 2 == 0)
        groups.append(batch_from_rows(rows, make_schema(resolve_fields(COLUMNS, "test"), "trajectory")))
    engine.close()
    return step_batch(groups)


def routing_of(batch: pa.RecordBatch, row: int, num_layers=2, top_k=2) -> np.ndarray:
    n = len(batch.column("token_ids")[row].as_py())
    return np.frombuffer(batch.column("routed_experts")[row].as_py(), np.int16).reshape(n, num_layers, top_k)


def test_multi_turn_routing_stays_aligned_with_the_tokens_and_only_the_last_is_unrouted(recorded):
    batch = recorded
    for row in range(batch.num_rows):
        routed = routing_of(batch, row)
        mask = batch.column("loss_mask")[row].as_py()
        assert mask.count(True) > 0 and (routed[:-1] >= 0).all() and (routed[-1] == -1).all()
        assert (routed < 4).all()
        assert all(len(set(pair)) == 2 for pair in routed[:-1].reshape(-1, 2).tolist())  # k distinct experts


def test_segment_keeps_the_first_turns_choices_and_fills_what_it_left_unrouted():
    from molt.agents.episode import Segment

    def completion(ids, routed):
        return Completion(ids, [-0.5] * len(ids), [0] * len(ids), "stop", np.array(routed, np.int16)[:, None, None])

    seg = Segment()
    seg.extend_context([10, 11])
    seg.extend_generated(completion([12, 13], [1, 2, 3, -1]))  # the last sampled token never routed
    seg.extend_context([14])  # env tokens
    seg.extend_generated(completion([15], [9, 9, 9, 4, 5, -1]))  # a recompute would differ: first turn wins
    routed = np.frombuffer(seg.row()["routed_experts"], np.int16)
    assert routed.tolist() == [1, 2, 3, 4, 5, -1] and len(seg.token_ids) == 6
    seg.extend_context([16, 17])  # env tokens after the last turn: never routed
    assert np.frombuffer(seg.row()["routed_experts"], np.int16).tolist() == [1, 2, 3, 4, 5, -1, -1, -1]
    with pytest.raises(ValueError, match="cover 2 tokens, the sequence has 9"):
        seg.extend_generated(completion([18], [1, 2]))


def rotated(batch: pa.RecordBatch) -> tuple[pa.RecordBatch, list[np.ndarray]]:
    """``batch`` with every recorded expert e replaced by e + 1 mod 4 (no top-2 set maps to itself, so
    they differ from the trainer's own choice) and each row's first 3 tokens unrouted; and those records."""
    rows = [routing_of(batch, r).copy() for r in range(batch.num_rows)]
    for routed in rows:
        routed[routed >= 0] = (routed[routed >= 0] + 1) % 4
        routed[:3] = -1
    column = pa.array([r.tobytes() for r in rows], pa.binary())
    return batch.set_column(batch.schema.get_field_index("routed_experts"), "routed_experts", column), rows


def test_replay_makes_the_trainers_experts_the_engines_on_every_routed_position(tiny_moe_distinct, recorded):
    batch = recorded
    permuted, rows = rotated(batch)  # unrouted tokens must follow the trainer's router
    own_stage = train_stage(tiny_moe_distinct)
    own = expert_inputs(own_stage.model)
    plain = stage_step(own_stage, batch)
    stage = train_stage(tiny_moe_distinct, routing_replay=True)
    used = expert_inputs(stage.model)
    router_before = stage.model.lm.model.layers[0].mlp.gate.weight.detach().clone()
    result = stage_step(stage, permuted)
    # The step's single micro-batch packs each group's prompt once: map rows to packed positions.
    from molt.train.packing import pack_sequences

    packed = pack_sequences(batch.column("token_ids").to_pylist(), batch.column("loss_mask").to_pylist())
    offset, checked = 0, 0
    for r, n in enumerate(packed.lengths):
        index = packed.token_index[offset:offset + n]
        for layer in range(2):
            trained = used[layer][index].sort(-1).values.numpy()
            engine = np.sort(rows[r][:, layer], -1)
            routed = engine[:, 0] >= 0
            assert (trained[routed] == engine[routed]).all()
            assert (trained[~routed] == own[layer][index].sort(-1).values.numpy()[~routed]).all()
            checked += int(routed.sum())
        offset += n
    assert checked > 100
    # Without replay the engine (fp32, same weights) and trainer agree; the permuted record almost never.
    assert plain.metrics["moe/routing_disagreement"] < 0.02
    assert result.metrics["moe/routing_disagreement"] > 0.9  # layer 1 sees replayed layer-0 output
    assert 0.5 < result.metrics["moe/routed_token_frac"] < 1.0
    assert not torch.equal(router_before, stage.model.lm.model.layers[0].mlp.gate.weight)  # the router learns


def test_replay_compare_logs_the_logprob_gap_both_ways(tiny_moe_distinct, recorded):
    permuted, _ = rotated(recorded)  # the engine's logprobs came from the trainer's own routing
    for replay in (False, True):
        stage = train_stage(tiny_moe_distinct, routing_replay=replay, routing_replay_compare=True)
        metrics = stage_step(stage, permuted).metrics
        ours = metrics["moe/logprob_diff_replay" if replay else "moe/logprob_diff_no_replay"]
        assert ours == pytest.approx(metrics["logprob_diff/abs_mean"], rel=1e-5)
        gap, gap_replayed = metrics["moe/logprob_diff_no_replay"], metrics["moe/logprob_diff_replay"]
        assert gap < 1e-4 and gap_replayed > max(10 * gap, 1e-4), (gap, gap_replayed)
        assert metrics["moe/routing_disagreement"] > 0.9  # the extra forward left the counts alone


def test_bad_routing_is_refused_naming_the_column_the_sample_or_the_key(tiny_moe_distinct, tiny_chat_model,
                                                                       recorded):
    batch = recorded
    column = batch.schema.get_field_index("routed_experts")
    short = batch.column("routed_experts").to_pylist()
    short[1] = short[1][:-4]
    stage = train_stage(tiny_moe_distinct, routing_replay=True)
    sample = batch.column("sample_id")[1].as_py()
    with pytest.raises(ValueError, match=rf"column 'routed_experts', sample '{sample}': .* x 2 MoE layers x top-2"):
        stage_step(stage, batch.set_column(column, "routed_experts", pa.array(short, pa.binary())))
    big = [np.full(len(b) // 2, 7, np.int16).tobytes() for b in batch.column("routed_experts").to_pylist()]
    with pytest.raises(ValueError, match=r"expert id 7 >= the model's 4 experts"):
        stage_step(stage, batch.set_column(column, "routed_experts", pa.array(big, pa.binary())))
    with pytest.raises(ValueError, match=r"stages.train.config.routing_replay: the model has no mixture-of-experts"):
        train_stage(tiny_chat_model, routing_replay=True)
    from molt.engines.hf import TransformersEngine

    with pytest.raises(ValueError, match="record_routing: the model has no mixture-of-experts router"):
        TransformersEngine(str(tiny_chat_model), record_routing=True)


def test_a_pipeline_replaying_routing_that_its_rollout_does_not_record_fails_at_load(tmp_path):
    from pathlib import Path

    from molt.runtime.pipeline import Pipeline

    text = Path("pipelines/moe.yaml").read_text()
    assert "routing_replay: true" in text and "record_routing: true" in text
    text = text.replace("record_routing: true", "record_routing: false").replace(
        "base: quickstart.yaml", f"base: {Path('pipelines/quickstart.yaml').resolve()}")
    (tmp_path / "p.yaml").write_text(text)
    with pytest.raises(ValueError, match=r"stage 'train' reads column 'routed_experts' which no upstream stage "
                                         r"writes"):
        Pipeline.from_yaml(tmp_path / "p.yaml")
