"""Train-vs-rollout logprob gap of a MoE with and without routing replay (R3), on CPU.

One step's rollouts (16 arithmetic prompts x 8 samples, temperature 0.8, at most 16 new
tokens) from vLLM recording its routing (`record_routing`), then the train stage's
step code on them (fp32 trainer, FSDP2 at world size 1, lr ~0) with
``routing_replay: true`` and ``routing_replay_compare: true``, which forwards every
micro-batch with and without replay: the mean |trainer - engine| logprob over the
generated tokens each way, and how often the trainer's own top-k differs from the
engine's (routed (token, layer) pairs; tokens differing in any layer).

The policy: the built-in upcycled MoE (``smollm2-135m-instruct-moe``) with every expert
perturbed by 30% of its weights' std (seeded): upcycled experts are identical copies,
with which the expert a token goes to cannot change its logprob. ``--dtype float32``
checks the recording instead: engine and trainer then agree on every token and layer.

Run: ``python bench/routing_replay.py [--dtype bfloat16]`` (about 4 min); ends with
``ratio routing_replay_gap R (replay X nats / no replay Y nats)``.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

GROUPS, GROUP_SIZE = 16, 8


def distinct_experts(source: Path, folder: Path) -> None:
    """Save ``source`` with each expert tensor plus 0.3 x its std of seeded noise into ``folder``."""
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(source)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lm.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.add_(0.3 * p.std() * torch.randn(p.shape, generator=gen))
    lm.save_pretrained(folder)
    for item in source.iterdir():
        if item.name.startswith(("tokenizer", "chat_template", "special_tokens", "generation")):
            shutil.copy(item, folder / item.name)


async def rollouts(folder: Path, dtype: str) -> list[pa.RecordBatch]:
    """One group of trajectory rows (with ``routed_experts``) per prompt."""
    from transformers import AutoTokenizer

    from molt.agents import ChatTemplate
    from molt.engines.base import SamplingParams
    from molt.engines.vllm import VLLMEngine
    from molt.schema import batch_from_rows, make_schema, resolve_fields

    chat = ChatTemplate(AutoTokenizer.from_pretrained(folder))
    engine = VLLMEngine(str(folder), dtype=dtype, max_model_len=512, kv_cache_gib=0.75, record_routing=True,
                        engine_kwargs={"block_size": 32})
    rng = np.random.default_rng(0)
    prompts = [chat.prompt_ids([{"role": "user", "content": f"What is {a} + {b}? Answer with just the number."}])
               for a, b in rng.integers(10, 60, (GROUPS, 2))]
    params = SamplingParams(temperature=0.8, max_new_tokens=16)
    start = time.perf_counter()
    outs = await asyncio.gather(*(engine.generate(f"p{i}/{k}", prompt, params)
                                  for i, prompt in enumerate(prompts) for k in range(GROUP_SIZE)))
    print(f"rollout: {len(outs)} samples in {time.perf_counter() - start:.1f} s")
    engine.close()
    columns = ("sample_id", "prompt_id", "token_ids", "loss_mask", "rollout_logprobs", "policy_version",
               "advantages", "routed_experts")
    schema = make_schema(resolve_fields(columns, "bench"), "trajectory")
    groups = []
    for i, prompt in enumerate(prompts):
        rows = []
        for k, out in enumerate(outs[i * GROUP_SIZE:(i + 1) * GROUP_SIZE]):
            n, p = len(out.token_ids), len(prompt)
            assert out.routed_experts is not None, "the engine records routing"
            rows.append({"sample_id": f"p{i}/{k}", "prompt_id": f"p{i}", "token_ids": prompt + out.token_ids,
                         "loss_mask": [False] * p + [True] * n, "rollout_logprobs": [0.0] * p + out.logprobs,
                         "policy_version": [-1] * p + [0] * n,
                         "advantages": [0.0] * p + [1.0 - 2 * (k % 2)] * n,  # nonzero: no row is skipped
                         "routed_experts": out.routed_experts.tobytes()})
        groups.append(batch_from_rows(rows, schema))
    return groups


def measure(folder: Path, groups: list[pa.RecordBatch]) -> dict[str, float]:
    """The step metrics of the train stage's step code on ``groups`` with replay and the comparison."""
    from molt.runtime.stage import StageContext
    from molt.train import load_policy, shard_policy, train_step
    from molt.train.optim import OptimConfig, make_optimizer
    from molt.train.step import ObjectiveConfig
    from stages.pack import Pack

    pack = Pack(Pack.Config(groups_per_step=len(groups), max_tokens_per_micro_batch=4096), StageContext("pack"))
    pack.setup()
    optim = OptimConfig(lr=1e-12)
    model = shard_policy(load_policy(folder, 0.8, chunk_tokens=1024))
    optimizer = make_optimizer(model, optim)
    objective = ObjectiveConfig.model_validate({"routing_replay": True, "routing_replay_compare": True})
    return train_step(model, optimizer, pack.place(groups), objective, optim, version=0).metrics


def main() -> None:
    from molt.models import resolve_model

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"], help="engine dtype")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="molt-bench-r3-") as tmp:
        folder = Path(tmp) / "moe-distinct"
        distinct_experts(resolve_model("smollm2-135m-instruct-moe"), folder)
        metrics = measure(folder, asyncio.run(rollouts(folder, args.dtype)))
    for key in ("tokens/count", "moe/routed_token_frac", "moe/routing_disagreement", "moe/routing_disagreement_tokens",
                "logprob_diff/abs_max"):
        print(f"{key}: {metrics[key]:.5f}")
    replay, plain = metrics["moe/logprob_diff_replay"], metrics["moe/logprob_diff_no_replay"]
    print(f"ratio routing_replay_gap {replay / max(plain, 1e-12):.3f} "
          f"(replay {replay:.5f} nats / no replay {plain:.5f} nats; engine {args.dtype}, trainer fp32)")


if __name__ == "__main__":
    main()
