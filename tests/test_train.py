"""Trainer: packed logprobs and attention, split invariance, world size 1 vs 2, staleness, export, the RL loop."""

import logging
import json
import os

import pyarrow as pa
import pytest
import torch

from molt.runtime.recording import read_batches
from molt.schema import batch_from_rows
from molt.runtime.stage import StageContext
from molt.train import ObjectiveConfig, OptimConfig, check_staleness, full_state_dict, train_step
from molt.train.attention import packed_sdpa, row_lengths, supports_packed_sdpa
from molt.train.logprobs import target_logprobs
from molt.train.model import load_policy, shard_policy
from molt.train.optim import make_optimizer, set_lr
from molt.train.packing import pack_sequences
from stages.pack import Pack
from tests.conftest import SINK, run_spec
from tests.test_pack import SCHEMA

TEMPERATURE = 0.8
OPTIM = OptimConfig(lr=1e-2, eps=1e-3, grad_clip=1.0)  # large eps: an update smooth in the gradient
OBJECTIVE = ObjectiveConfig.model_validate({"policy_loss": {"type": "ppo", "clip_high": 0.28},
                                            "correction": {"type": "tis", "cap": 2.0}})


def random_groups(num_groups=4, per_group=2, seed=0, version=0):
    gen = torch.Generator().manual_seed(seed)
    groups = []
    for g in range(num_groups):
        rows = []
        for k in range(per_group):
            n, gen_len = int(torch.randint(6, 14, (1,), generator=gen)), int(torch.randint(0, 5, (1,), generator=gen))
            mask = [False] * (n - gen_len) + [True] * gen_len
            rows.append({"sample_id": f"p{g}/{k}", "prompt_id": f"p{g}", "rollout_id": f"p{g}/{k}",
                         "token_ids": torch.randint(3, 49152, (n,), generator=gen).tolist(), "loss_mask": mask,
                         "rollout_logprobs": [-10.8 + 0.3 * float(torch.randn(1, generator=gen)) if m else 0.0
                                              for m in mask],
                         "policy_version": [version if m else -1 for m in mask],
                         "advantages": [(1.0 - 2 * (k % 2)) * (g + 1) / 4 if m else 0.0 for m in mask],
                         "reward": float(k % 2 == 0)})
        groups.append(batch_from_rows(rows, SCHEMA))
    return groups


def step_batch(groups, world_size=1, max_tokens=4096):
    pack = Pack(Pack.Config(groups_per_step=len(groups), world_size=world_size,
                            max_tokens_per_micro_batch=max_tokens), StageContext("pack"))
    pack.setup()
    return pack.place(groups)


def train_once(model_dir, batch, compute_dtype="float32", lora=None):
    torch.manual_seed(0)
    model = load_policy(model_dir, TEMPERATURE, chunk_tokens=5)
    if lora is not None:
        model.add_lora(lora)
    model = shard_policy(model, compute_dtype)
    optimizer = make_optimizer(model, OPTIM)
    result = train_step(model, optimizer, batch, OBJECTIVE, OPTIM, version=0)
    return result, full_state_dict(model)


def test_a_packed_row_gives_the_same_logprobs_as_the_row_alone(tiny_chat_model):
    model = load_policy(tiny_chat_model, TEMPERATURE, chunk_tokens=4)
    a, b = list(range(100, 109)), list(range(300, 306))
    both = pack_sequences([a, b])
    alone = pack_sequences([b])
    with torch.no_grad():
        packed_b = model(both.input_ids, both.position_ids)[len(a):]
        alone_b = model(alone.input_ids, alone.position_ids)
        logits = model.lm(input_ids=alone.input_ids).logits[0, :-1].float() / TEMPERATURE
    reference = torch.log_softmax(logits, -1).gather(-1, alone.input_ids[0, 1:, None])[:, 0]
    assert packed_b[0] == 0.0 and alone_b[0] == 0.0, "a row's first token has no prediction"
    torch.testing.assert_close(packed_b, alone_b, atol=1e-5, rtol=0)
    torch.testing.assert_close(alone_b[1:], reference, atol=1e-5, rtol=0)


def test_rows_sharing_a_prompt_forward_it_once_with_the_same_logprobs_and_gradients(tiny_chat_model):
    prompt = list(range(200, 212))
    rows = [prompt + [5, 6, 7], prompt + [8], prompt + [9, 10, 11, 12], [40, 41, 42, 43], prompt + [5, 6]]
    masks = [[False] * len(prompt) + [True] * (len(r) - len(prompt)) for r in rows[:3]] + \
        [[False, True, True, False], [False] * len(prompt) + [True, True]]
    shared = pack_sequences(rows, masks)
    assert shared.input_ids.shape[1] == len(prompt) + 3 + 1 + 4 + 4 + 2, "the prompt is forwarded once"
    assert [(n, p) for n, p, _ in shared.segments] == [(len(prompt) + 10, len(prompt)), (4, 0)]
    weights = torch.randn(sum(len(r) for r in rows), generator=torch.Generator().manual_seed(0))
    flat_mask = torch.tensor([m for mask in masks for m in mask])
    results = []
    for packed in (shared, pack_sequences(rows)):
        model = load_policy(tiny_chat_model, TEMPERATURE, chunk_tokens=5)
        assert model.shares_prompts
        logp = model(packed.input_ids, packed.position_ids, packed, masks)  # [sum lengths], rows in order
        (logp * weights).sum().backward()
        results.append((logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    (a, grads_a), (b, grads_b) = results
    assert a[~flat_mask].abs().sum() == 0 and a[flat_mask].abs().min() > 0, "only loss tokens are projected"
    torch.testing.assert_close(a, b, atol=1e-5, rtol=0)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grad, grads_b[name], atol=1e-5, rtol=1e-4, msg=name)


def test_rows_with_zero_advantage_are_skipped_without_changing_the_update(tiny_chat_model, monkeypatch):
    import numpy as np

    import molt.train.step as step_module

    groups = random_groups(seed=2)
    flat = pa.Table.from_batches(groups).to_pylist()
    for row in flat[:4]:  # two whole groups scored alike: advantage 0 everywhere
        row["advantages"] = [0.0] * len(row["advantages"])
    batch = step_batch([batch_from_rows(flat, SCHEMA)])
    zero = {r["sample_id"] for r in flat[:4]}
    assert step_module.inert_rows(batch, OBJECTIVE).tolist() == [r in zero for r in batch.column("sample_id").to_pylist()]
    skipped = train_once(tiny_chat_model, batch)
    assert skipped[0].metrics["rows/inert_frac"] == pytest.approx(4 / batch.num_rows)
    monkeypatch.setattr(step_module, "inert_rows", lambda b, o: np.zeros(b.num_rows, dtype=bool))
    computed = train_once(tiny_chat_model, batch)
    assert skipped[0].loss == pytest.approx(computed[0].loss, rel=1e-5)
    for name, tensor in computed[1].items():
        torch.testing.assert_close(skipped[1][name], tensor, atol=1e-6, rtol=0)
    kl = ObjectiveConfig.model_validate({"kl": {"estimator": "k3", "coef": 0.1, "apply_to": "loss"}})
    assert not step_module.inert_rows(batch, kl).any(), "a KL term has a gradient at advantage 0"


@pytest.mark.parametrize("chunk_tokens", [3, 7, 100])  # last chunk of 1; one chunk, exact; one chunk, larger
def test_chunked_logprobs_match_full_vocab_autograd_in_value_and_gradient(chunk_tokens):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, requires_grad=True)
    weight = torch.randn(11, 5, generator=gen, requires_grad=True)
    targets = torch.randint(0, 11, (7,), generator=gen)
    upstream = torch.randn(7, generator=gen)
    ours = target_logprobs(hidden, weight, targets, 0.7, chunk_tokens=chunk_tokens)
    (ours * upstream).sum().backward()
    grads = hidden.grad.clone(), weight.grad.clone()
    hidden.grad, weight.grad = None, None
    ref = torch.log_softmax(hidden @ weight.t() / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grads, (hidden.grad, weight.grad))
    with pytest.raises(ValueError, match="temperature"):
        target_logprobs(hidden, weight, targets, 0.0)


def test_bfloat16_logprobs_project_in_float32_and_return_bfloat16_gradients():
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(6, 5, generator=gen).bfloat16().requires_grad_()
    weight = torch.randn(11, 5, generator=gen).bfloat16().requires_grad_()
    targets = torch.randint(0, 11, (6,), generator=gen)
    ours = target_logprobs(hidden, weight, targets, 0.7, chunk_tokens=4)
    ours.sum().backward()
    ref_h, ref_w = hidden.detach().float().requires_grad_(), weight.detach().float().requires_grad_()
    ref = torch.log_softmax(ref_h @ ref_w.t() / 0.7, -1).gather(-1, targets[:, None])[:, 0]
    ref.sum().backward()
    assert ours.dtype == torch.float32 and hidden.grad.dtype == weight.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=0)
    torch.testing.assert_close(hidden.grad.float(), ref_h.grad, atol=2e-2, rtol=1e-2)
    torch.testing.assert_close(weight.grad.float(), ref_w.grad, atol=2e-2, rtol=1e-2)


def test_row_lengths_follow_the_position_restarts():
    assert row_lengths(torch.tensor([0, 1, 2, 0, 1])) == [3, 2]
    assert row_lengths(torch.tensor([0, 0, 0])) == [1, 1, 1]
    assert row_lengths(torch.arange(6)) == [6]
    assert row_lengths(torch.tensor([4, 5, 0])) == [2, 1]  # a jump that is not a restart to 0 also starts a row


def test_packed_attention_equals_sdpa_with_the_block_diagonal_mask_in_value_and_gradient():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    gen = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.num_key_value_groups, module.is_causal = 2, True  # 4 query heads on 2 kv heads
    q = torch.randn(1, 4, 9, 8, generator=gen, requires_grad=True)
    k = torch.randn(1, 2, 9, 8, generator=gen, requires_grad=True)
    v = torch.randn(1, 2, 9, 8, generator=gen, requires_grad=True)
    upstream = torch.randn(1, 9, 4, 8, generator=gen)
    position_ids = torch.tensor([[0, 1, 2, 3, 0, 1, 0, 1, 2]])
    ours = packed_sdpa(module, q, k, v, None, position_ids=position_ids, scaling=8 ** -0.5)[0]
    (ours * upstream).sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    row = torch.tensor([0] * 4 + [1] * 2 + [2] * 3)
    mask = (row[:, None] == row[None, :]) & torch.ones(9, 9, dtype=torch.bool).tril()  # [S, S] block-diagonal causal
    ref = sdpa_attention_forward(module, q, k, v, mask[None, None], scaling=8 ** -0.5)[0]
    (ref * upstream).sum().backward()
    torch.testing.assert_close(ours, ref)
    torch.testing.assert_close(grads, [t.grad for t in (q, k, v)])


def test_the_policy_uses_packed_attention_and_keeps_padding_masks(tiny_chat_model):
    from transformers import LlamaConfig, MistralConfig

    model = load_policy(tiny_chat_model, TEMPERATURE)
    assert model.lm.config._attn_implementation == "molt_packed_sdpa"
    ids = torch.randint(3, 49152, (2, 6), generator=torch.Generator().manual_seed(0))
    padding = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 0, 0]])
    with torch.no_grad():
        ours = model.lm(input_ids=ids, attention_mask=padding).logits
        model.lm.set_attn_implementation("sdpa")
        ref = model.lm(input_ids=ids, attention_mask=padding).logits
    torch.testing.assert_close(ours, ref)
    assert supports_packed_sdpa(LlamaConfig())
    assert not supports_packed_sdpa(MistralConfig(sliding_window=64)), "a sliding window needs a mask"


def test_one_rank_in_float32_is_left_unwrapped_and_bfloat16_is_sharded(tiny_chat_model):
    from torch.distributed.tensor import DTensor

    plain = shard_policy(load_policy(tiny_chat_model, TEMPERATURE))
    assert not any(isinstance(p, DTensor) for p in plain.parameters())
    groups = random_groups()
    fp32, _ = train_once(tiny_chat_model, step_batch(groups))
    bf16, weights = train_once(tiny_chat_model, step_batch(groups), compute_dtype="bfloat16")
    assert bf16.loss == pytest.approx(fp32.loss, rel=0.05) and weights["model.norm.weight"].dtype == torch.float32


def test_one_two_or_four_micro_batches_give_the_same_loss_and_weights(tiny_chat_model):
    groups = random_groups()
    results = []
    for max_tokens in (4096, 45, 25):
        batch = step_batch(groups, max_tokens=max_tokens)
        results.append((int(max(batch.column("micro_batch").to_pylist())) + 1, *train_once(tiny_chat_model, batch)))
    assert [r[0] for r in results] == [1, 2, 4]
    (_, base, base_w), others = results[0], results[1:]
    assert base.loss != 0.0 and base.grad_norm > 0
    for _, result, weights in others:
        assert result.loss == pytest.approx(base.loss, rel=1e-5, abs=1e-7)
        assert result.grad_norm == pytest.approx(base.grad_norm, rel=1e-4)
        for name, tensor in base_w.items():
            torch.testing.assert_close(weights[name], tensor, atol=2e-6, rtol=0)


def _rank_main(rank, world_size, model_dir, batch_bytes, out_path, init_file, lora):
    import torch.distributed as dist
    from safetensors.torch import save_file

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    batch = pa.ipc.open_stream(batch_bytes).read_next_batch()
    result, weights = train_once(model_dir, batch, lora=lora)
    if rank == 0:
        save_file(weights, out_path, metadata={"loss": repr(result.loss)})
    dist.destroy_process_group()


def check_two_ranks_give_the_one_rank_update(model_dir, tmp_path, lora=None):
    """One step of the same groups on one rank and on two (spawned, gloo): same loss and weights."""
    from safetensors import safe_open

    groups = random_groups(seed=1)
    base, base_w = train_once(model_dir, step_batch(groups, max_tokens=30), lora=lora)
    batch = step_batch(groups, world_size=2, max_tokens=30)
    assert set(batch.column("dp_rank").to_pylist()) == {0, 1}
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, batch.schema) as writer:
        writer.write_batch(batch)
    out = tmp_path / "ws2.safetensors"
    torch.multiprocessing.spawn(_rank_main, args=(2, str(model_dir), sink.getvalue().to_pybytes(), str(out),
                                                  str(tmp_path / "init"), lora), nprocs=2, join=True)
    with safe_open(str(out), "pt") as handle:
        assert float(handle.metadata()["loss"]) == pytest.approx(base.loss, rel=1e-5)
        for name, tensor in base_w.items():
            torch.testing.assert_close(handle.get_tensor(name), tensor, atol=2e-6, rtol=0)


def test_world_size_two_gives_the_same_update_as_world_size_one(tiny_chat_model, tmp_path):
    check_two_ranks_give_the_one_rank_update(tiny_chat_model, tmp_path)


def test_lr_scale_gives_the_parameters_under_a_module_their_own_lr_on_the_same_schedule(caplog):
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"model": torch.nn.ModuleDict({"vision_tower": torch.nn.Linear(3, 3),
                                                               "language_model": torch.nn.Linear(3, 3)})})
    cfg = OptimConfig(lr=1e-3, warmup_steps=2, lr_scale={"model.vision_tower|visual": 10.0}, grad_clip=None)
    optimizer = make_optimizer(model, cfg)
    assert sorted(group["lr"] for group in optimizer.param_groups) == pytest.approx([5e-4, 5e-3])
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    towers = model["model"]
    (towers["vision_tower"](torch.ones(3)).sum() + towers["language_model"](torch.ones(3)).sum()).backward()
    optimizer.step()  # Adam's first step moves each weight by about its lr
    moved = {name: float((p.detach() - before[name]).abs().mean()) for name, p in model.named_parameters()}
    assert moved["model.vision_tower.weight"] == pytest.approx(5e-3, rel=1e-3)
    assert moved["model.language_model.weight"] == pytest.approx(5e-4, rel=1e-3)
    assert set_lr(optimizer, 5, cfg) == 1e-3
    assert sorted(group["lr"] for group in optimizer.param_groups) == pytest.approx([1e-3, 1e-2])
    resumed_cfg = cfg.model_copy(update={"lr_scale": {"model.vision_tower|visual": 5.0}})
    resumed = make_optimizer(model, resumed_cfg)
    resumed.load_state_dict(optimizer.state_dict())  # the configured scale holds, not the checkpoint's
    set_lr(resumed, 5, resumed_cfg)
    assert sorted(group["lr"] for group in resumed.param_groups) == pytest.approx([1e-3, 5e-3])
    with pytest.raises(ValueError, match=r"optim.lr_scale.vision_towr: takes no trainable .* \['vision_tower'\]"):
        make_optimizer(model, OptimConfig(lr_scale={"vision_towr": 2.0}), "stages.train.config.optim")
    with pytest.raises(ValueError, match=r"lr_scale.vision_tower: .* or an earlier key took them"):
        make_optimizer(model, OptimConfig(lr_scale={"model": 2.0, "vision_tower": 0.5}))
    towers["vision_tower"].requires_grad_(False)  # frozen (a tower under policy.lora): its key is ignored, said
    with caplog.at_level(logging.WARNING, "molt.train.optim"):
        frozen = make_optimizer(model, cfg, "stages.train.config.optim")
    assert [len(group["params"]) for group in frozen.param_groups] == [2]
    assert "stages.train.config.optim.lr_scale.model.vision_tower|visual: every parameter it takes is frozen (2 " \
           "tensors" in caplog.text


def test_a_stale_token_is_refused_naming_its_sample():
    batch = step_batch(random_groups(num_groups=2, version=1))
    assert check_staleness(batch, version=2, max_staleness=1) == 1
    with pytest.raises(ValueError, match=r"sample 'p\d/\d' .* 2 steps behind .* max_staleness is 1"):
        check_staleness(batch, version=3, max_staleness=1)


def test_the_export_has_exactly_the_model_folders_names_and_loads_into_the_engine(tiny_chat_model, tmp_path):
    import asyncio

    from safetensors import safe_open
    from safetensors.torch import save_file

    from molt.engines.hf import TransformersEngine
    from molt.engines.refit import file_digests
    from molt.refit import verify_refit

    _, weights = train_once(tiny_chat_model, step_batch(random_groups()))
    with safe_open(str(tiny_chat_model / "model.safetensors"), "pt") as handle:
        assert set(weights) == set(handle.keys()) and "lm_head.weight" not in weights
    path = str(tmp_path / "v1.safetensors")
    save_file(weights, path)
    engine = TransformersEngine(str(tiny_chat_model))
    asyncio.run(engine.load_weights(path, 1))
    verify_refit(1, file_digests(path), engine.last_weight_digests)


def rl_pipeline(model, world_size):
    return {"name": "rl", "stop_timeout_s": 10, "stages": {
        "source": {"class": "stages.dataset_source.DatasetSource",
                   "config": {"task": {"type": "arithmetic", "num_problems": 4}, "prompts_per_batch": 2}},
        "rollout": {"class": "stages.rollout.Rollout", "config": {
            "model": str(model), "engine": {"type": "transformers"}, "group_size": 2, "max_new_tokens": 4,
            "seed": 1, "temperature": 1.0, "weights_input": True, "max_staleness": 1, "groups_per_step": 2}},
        "reward": {"class": "stages.reward.Reward"},
        "shape": {"class": "tests.doubles.stages.HashReward"},
        "advantage": {"class": "stages.group_advantage.GroupAdvantage"},
        "pack": {"class": "stages.pack.Pack", "config": {"groups_per_step": 2, "world_size": world_size,
                                                         "max_tokens_per_micro_batch": 128}},
        "train": {"class": "stages.train.Train", "world_size": world_size, "config": {
            "model": str(model), "temperature": 1.0, "max_staleness": 1,
            # two param groups through checkpoints and re-sharding; scale 1 keeps the updates bit-comparable
            # across world sizes (at 2.0 one weight of layer 0 differed by 1.3e-6 between 1 and 2 ranks)
            "optim": {"lr": 1e-3, "lr_scale": {"layers.0": 1.0}}}},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "rollout.in"}, {"from": "rollout", "to": "reward"},
                  {"from": "reward", "to": "shape"},
                  {"from": "shape", "to": "advantage"}, {"from": "advantage", "to": "pack"},
                  {"from": "pack", "to": "train"}, {"from": "train.out", "to": "sink", "record": True},
                  {"from": "train.weights", "to": "rollout.weights", "kind": "broadcast", "feedback": True}]}


@pytest.mark.timeout(180)  # the deadlock it guards against would otherwise hang until the default 600 s
def test_a_lost_group_does_not_stall_an_on_policy_loop(tiny_chat_model, tmp_path, no_orphans):
    """Every rollout of prompt 1 fails: with max_staleness 0 the next prompt must take its place in step 0
    (before, the pack waited for a second group the rollout would only admit at version 1: a deadlock)."""
    spec = rl_pipeline(tiny_chat_model, 1)
    spec["stop_timeout_s"] = 5
    spec["stages"]["source"]["config"]["task"]["num_problems"] = 5
    spec["stages"]["rollout"]["config"].update(max_staleness=0, env="tests.doubles.stages.LosesPromptOneEnv")
    del spec["stages"]["reward"]  # the env scores
    spec["edges"] = [e for e in spec["edges"] if "reward" not in (e["from"], e["to"])] + [
        {"from": "rollout", "to": "shape"}]
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    m = summary["metrics"]
    assert m["rollout/groups_lost"] == 1 and m["rollout/rollouts_failed"] == 2 and m["train/policy_version"] == 2


def with_evaluation(spec, model):
    """``rl_pipeline`` plus a held-out evaluation of every version (8 problems, transformers engine); the
    rollout admits on-policy, so it must refit to version 1 before step 1's groups."""
    spec["stages"]["rollout"]["config"]["max_staleness"] = 0
    spec["stages"]["evaluate"] = {"class": "stages.evaluate.Evaluate", "config": {
        "model": str(model), "engine": {"type": "transformers"}, "max_new_tokens": 4,
        "task": {"type": "arithmetic", "split": "eval", "num_problems": 8}}}
    spec["stages"]["eval_sink"] = {"class": SINK}
    spec["edges"] += [{"from": "train.weights", "to": "evaluate.weights", "kind": "broadcast"},
                      {"from": "evaluate", "to": "eval_sink", "record": True}]
    return spec


def test_an_evaluation_can_take_its_weights_from_a_second_output_of_the_trainer(tiny_chat_model, tmp_path, no_orphans):
    """As pipelines/gsm8k_gpu.yaml does when the rollout's refits go over NCCL: the trainer publishes
    every 2nd version as a file on a second output (publish.eval_weights)."""
    spec = with_evaluation(rl_pipeline(tiny_chat_model, 1), tiny_chat_model)
    spec["stages"]["train"]["config"]["publish"] = {"eval_weights": {"every_steps": 2, "keep_versions": 1}}
    spec["edges"] = [e for e in spec["edges"] if e["to"] != "evaluate.weights"] + [
        {"from": "train.eval_weights", "to": "evaluate.weights", "kind": "broadcast"}]
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    evals = [r["policy_version"] for b in read_batches(tmp_path / "run" / "record" / "evaluate.out--eval_sink.in")
             for r in b.to_pylist()]
    assert evals == [0, 2], "the initial weights, then the second output's only version"
    assert summary["metrics"]["rollout/refit_seconds"] >= 0 and summary["metrics"]["train/policy_version"] == 2


@pytest.mark.parametrize("world_size", [1, pytest.param(2, marks=pytest.mark.slow)])
def test_the_rl_loop_trains_publishes_refits_and_evaluates_through_the_real_runner(
        tiny_chat_model, tmp_path, world_size, no_orphans):
    before = {p for p in os.listdir("/dev/shm") if p.startswith(("molt-weights-", "molt-eval-"))}
    code, summary = run_spec(with_evaluation(rl_pipeline(tiny_chat_model, world_size), tiny_chat_model),
                             tmp_path / "run")
    assert code == 0, summary.get("error")
    evals = [r for b in read_batches(tmp_path / "run" / "record" / "evaluate.out--eval_sink.in")
             for r in b.to_pylist()]
    assert [r["policy_version"] for r in evals][0] == 0 and evals[-1]["policy_version"] == 2, "initial and final"
    for r in evals:
        p = r["accuracy"]
        assert r["num_problems"] == 8 and r["accuracy_stderr"] == pytest.approx((p * (1 - p) / 8) ** 0.5)
    assert summary["metrics"]["evaluate/accuracy_baseline"] == evals[0]["accuracy"]
    steps = [r for b in read_batches(tmp_path / "run" / "record" / "train.out--sink.in") for r in b.to_pylist()]
    assert [r["step"] for r in steps] == [0, 1] and [r["policy_version"] for r in steps] == [1, 2]
    assert all(r["max_lag"] <= 1 and r["num_rows"] == 4 and r["grad_norm"] > 0 for r in steps)
    assert summary["metrics"]["rollout/refit_seconds"] >= 0, "the rollout loaded (and verified) new weights"
    log = (tmp_path / "run" / "logs" / "train.0.log").read_text()
    assert "step 1  loss" in log and "tok/s" in log and " entropy " in log
    metrics = summary["metrics"]  # molt.train.collapse: the trainer's entropy and the step's group shares
    assert metrics["train/entropy/mean"] > 0 and metrics["train/collapse/alarms"] in (0, 1)
    assert 0 <= metrics["train/collapse/identical_wrong_frac"] <= metrics["train/collapse/identical_groups_frac"] \
        <= metrics["train/collapse/zero_variance_frac"] <= 1
    assert {p for p in os.listdir("/dev/shm") if p.startswith(("molt-weights-", "molt-eval-"))} <= before, \
        "weight files removed"
    assert json.loads((tmp_path / "run" / "status" / "sink.0.json").read_text())["state"] == "done"
