"""The trainer's CUDA paths on one GPU: packed attention, FSDP2 on NCCL in bf16, MoE layers, the train stage.

Marked ``gpu`` (deselected by default; run ``pytest -m gpu`` on a machine with CUDA).
Each model is a small random one built here, so nothing needs the default model's
weights. The references are the CPU fp32 paths that tests/test_train.py checks.
"""

import json
import re

import pytest
import torch
import torch.distributed as dist

from molt.runtime.recording import read_batches
from molt.train import ObjectiveConfig, OptimConfig, full_state_dict, train_step
from molt.train.model import ensure_process_group, load_policy, shard_policy
from molt.train.optim import make_optimizer
from molt.train.packing import pack_sequences
from tests.conftest import SINK, SOURCE, run_spec
from tests.test_train import OBJECTIVE, OPTIM, random_groups, step_batch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]
VOCAB = 49152  # random_groups draws token ids below this


@pytest.fixture(scope="module", autouse=True)
def nccl_group():
    """One-rank group with an NCCL backend for CUDA tensors (a gloo-only group left by CPU tests is replaced)."""
    if dist.is_initialized() and "nccl" not in str(dist.get_backend_config()):
        dist.destroy_process_group()
    ensure_process_group("cuda:0")


def save_model(folder, kind):
    from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

    torch.manual_seed(0)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                  eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    if kind == "dense":
        LlamaForCausalLM(LlamaConfig(**common)).save_pretrained(folder)
    else:
        MixtralForCausalLM(MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)).save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=["dense", "moe"])
def model_dir(request, tmp_path_factory):
    return save_model(tmp_path_factory.mktemp(request.param), request.param)


def rows_alone_and_packed(model, rows):
    """(each row's logprobs run alone, the same rows cut out of one packed forward), on CPU."""
    alone = [_forward(model, [r]).cpu() for r in rows]
    return alone, list(_forward(model, rows).cpu().split([len(r) for r in rows]))


def _forward(model, rows):
    packed = pack_sequences(rows)
    with torch.no_grad():
        return model(packed.input_ids, packed.position_ids).float()


def test_packed_rows_on_cuda_match_each_row_alone_and_the_cpu_model(model_dir):
    gen = torch.Generator().manual_seed(0)
    rows = [torch.randint(3, VOCAB, (n,), generator=gen).tolist() for n in (37, 5, 64, 1, 23)]
    cpu = load_policy(model_dir, 0.8)
    reference = [_forward(cpu, [r]) for r in rows]
    for dtype, atol in (("float32", 1e-4), ("bfloat16", 0.1)):
        model = load_policy(model_dir, 0.8)
        model.to("cuda").to(torch.bfloat16 if dtype == "bfloat16" else torch.float32)
        alone, packed = rows_alone_and_packed(model, rows)
        for a, p, ref in zip(alone, packed, reference):
            torch.testing.assert_close(p, a, atol=atol / 10, rtol=0)  # same rows, same kernels, any packing
            torch.testing.assert_close(a, ref, atol=atol, rtol=0)


def test_shared_prompt_packing_on_cuda_matches_rows_packed_apart(model_dir):
    prompt = list(range(300, 340))
    rows = [prompt + [7, 8, 9], prompt + [5], prompt + [11, 12, 13, 14, 15], [60, 61, 62]]
    masks = [[False] * 40 + [True] * (len(r) - 40) for r in rows[:3]] + [[False, True, True]]
    model = shard_policy(load_policy(model_dir, 0.8), "bfloat16", "cuda")
    with torch.no_grad():
        shared, apart = (model(p.input_ids, p.position_ids, p, masks).cpu()
                         for p in (pack_sequences(rows, masks), pack_sequences(rows)))
    torch.testing.assert_close(shared, apart, atol=0.05, rtol=0)
    assert shared.abs().sum() > 0


def test_a_bf16_fsdp2_step_on_nccl_matches_the_cpu_fp32_step(model_dir):
    batch = step_batch(random_groups(seed=3), max_tokens=40)
    results, weights = {}, {}
    for device, dtype in (("cpu", "float32"), ("cuda", "bfloat16")):
        torch.manual_seed(0)
        model = load_policy(model_dir, 0.8, chunk_tokens=16)
        start = {k: v.clone() for k, v in full_state_dict(shard_policy(model, dtype, device)).items()}
        assert (device == "cuda") == hasattr(next(model.parameters()), "full_tensor")  # FSDP2-sharded on cuda
        optimizer = make_optimizer(model, OPTIM)
        results[device] = train_step(model, optimizer, batch, OBJECTIVE, OPTIM, version=0)
        weights[device] = {k: v - start[k] for k, v in full_state_dict(model).items()}
    assert results["cuda"].loss == pytest.approx(results["cpu"].loss, rel=0.05, abs=1e-3)
    assert results["cuda"].grad_norm == pytest.approx(results["cpu"].grad_norm, rel=0.05)
    for key in ("tokens/count", "policy/clip_fraction"):
        if key in results["cpu"].metrics:
            assert results["cuda"].metrics[key] == pytest.approx(results["cpu"].metrics[key], abs=0.05)
    for name, delta in weights["cpu"].items():
        gpu = weights["cuda"][name]
        assert gpu.dtype == torch.float32, f"{name}: master weights must stay fp32"
        if delta.norm() > 0:  # every trained tensor moved the same way
            cosine = torch.nn.functional.cosine_similarity(delta.flatten(), gpu.flatten(), dim=0)
            assert cosine > 0.9, f"{name}: cos(update cpu, update cuda) = {float(cosine):.3f}"


def test_micro_batch_split_on_cuda_does_not_change_the_step(model_dir):
    groups = random_groups(seed=5)
    losses = []
    for max_tokens in (4096, 30):
        torch.manual_seed(0)
        model = shard_policy(load_policy(model_dir, 0.8, chunk_tokens=7), "bfloat16", "cuda")
        optimizer = make_optimizer(model, OPTIM)
        batch = step_batch(groups, max_tokens=max_tokens)
        losses.append((batch.column("micro_batch").to_numpy().max(),
                       train_step(model, optimizer, batch, OBJECTIVE, OPTIM, version=0)))
    (one, a), (many, b) = losses
    assert one == 0 and many >= 2
    assert b.loss == pytest.approx(a.loss, rel=1e-2, abs=1e-4)
    assert b.grad_norm == pytest.approx(a.grad_norm, rel=1e-2)


def test_moe_experts_and_router_are_trained_on_cuda(tmp_path):
    folder = save_model(tmp_path / "moe", "moe")
    model = shard_policy(load_policy(folder, 1.0), "bfloat16", "cuda")
    before = {k: v.clone() for k, v in full_state_dict(model).items()}
    optimizer = make_optimizer(model, OptimConfig(lr=1e-2))
    result = train_step(model, optimizer, step_batch(random_groups(seed=7)), ObjectiveConfig(), OptimConfig(lr=1e-2),
                        version=0)
    assert torch.isfinite(torch.tensor(result.loss)) and result.grad_norm > 0
    after = full_state_dict(model)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    for part in ("gate", "experts"):
        names = [k for k in before if f"mlp.{part}" in k]
        assert names and set(names) <= moved, f"{part}: not updated: {sorted(set(names) - moved)}"


def test_the_train_stage_runs_on_cuda_through_the_real_runner(tmp_path):
    model = save_model(tmp_path / "model", "dense")
    spec = {"name": "gpu_train", "stop_timeout_s": 30, "stages": {
        "source": {"class": SOURCE, "config": {"num_groups": 8, "group_size": 4, "groups_per_batch": 2,
                                               "vocab_size": VOCAB, "max_new_tokens": 24}},
        "shape": {"class": "stages.shape_reward.ShapeReward", "config": {"max_new_tokens": 24}},
        "advantage": {"class": "stages.group_advantage.GroupAdvantage"},
        "pack": {"class": "stages.pack.Pack", "config": {"groups_per_step": 2, "max_tokens_per_micro_batch": 96}},
        "train": {"class": "stages.train.Train", "config": {
            "model": str(model), "temperature": 1.0, "device": "cuda", "compute_dtype": "bfloat16",
            "max_staleness": None, "optim": {"lr": 1e-3}, "publish": {"weights": {"dir": str(tmp_path)}}}},
        "sink": {"class": SINK}, "weights_sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "shape"}, {"from": "shape", "to": "advantage"},
                  {"from": "advantage", "to": "pack"}, {"from": "pack", "to": "train"},
                  {"from": "train.out", "to": "sink", "record": True},
                  {"from": "train.weights", "to": "weights_sink", "record": True}]}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, json.dumps(summary)[:2000]
    steps = [r for b in read_batches(tmp_path / "run" / "record" / "train.out--sink.in") for r in b.to_pylist()]
    assert [r["policy_version"] for r in steps] == [1, 2, 3, 4]
    assert all(r["num_rows"] == 8 and r["loss"] == r["loss"] for r in steps)
    published = [r for b in read_batches(tmp_path / "run" / "record" / "train.weights--weights_sink.in")
                 for r in b.to_pylist()]
    assert [r["policy_version"] for r in published] == [1, 2, 3, 4]
    line = re.search(r"step 3 .* mem ([0-9.]+)GB", (tmp_path / "run" / "logs" / "train.0.log").read_text())
    assert line and float(line.group(1)) > 0  # the CUDA allocator's peak
