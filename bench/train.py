"""Trainer step throughput vs a plain single-process PyTorch loop, same model and batch, same run.

Batch: ``--rows`` random sequences of ``--tokens`` tokens each (the last half generated,
advantages +-1), the default model (SmolLM2-135M, fp32 master weights).
Molt: ``molt.train`` as the train stage runs it at world size 1 (`shard_policy` on a
one-rank gloo group: left unwrapped in fp32, FSDP2 in bf16; one packed micro-batch with
per-row attention, chunked logprobs, PPO loss with token-mean over the step, AdamW,
clip). Baseline: ``AutoModelForCausalLM`` + AdamW, a ``[B, T]`` batch with an all-ones
attention mask (rows are equally long), full logits, ``log_softmax``/``gather``, the
same PPO loss, clip, step. Each side runs in its own spawned process (so peak RSS is its
own): ``--warmup`` steps, then ``--steps`` timed steps; the two sides alternate
``--repeats`` times and each keeps its fastest step (other load on the host only slows a
step down); the median and slowest step and the process CPU seconds are printed too.
Run: ``python bench/train.py [--rows 4 --tokens 128]``; on a GPU ``--device cuda --dtype
bfloat16`` (peak memory is then the CUDA allocator's; the baseline runs under autocast).
Ends with ``ratio train R (molt X tok/s / baseline Y tok/s)``.

``--lora RANK``: the baseline is molt.train training the whole policy, the other side trains
LoRA adapters of that rank (alpha 2 x rank, every attention and MLP linear: molt.train.lora) on the
frozen policy; of a MoE (``--model smollm2-135m-instruct-moe``), as pipelines/moe_lora.yaml, the
attention's linears, routers frozen: the
trade-off of ``policy.lora``, peak RSS and s/step against full fine-tuning; ratio is lora / full.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import queue as queue_module
import resource
import time

import torch

from molt.algorithms import ppo_clip_loss
from molt.models import resolve_model

TEMPERATURE = 1.0


def make_rows(args: argparse.Namespace) -> list[dict]:
    gen = torch.Generator().manual_seed(0)
    rows = []
    for i in range(args.rows):
        ids = torch.randint(3, 49152, (args.tokens,), generator=gen).tolist()
        mask = [k >= args.tokens // 2 for k in range(args.tokens)]
        rows.append({"sample_id": f"s{i}", "prompt_id": f"p{i // 2}", "rollout_id": f"s{i}", "token_ids": ids,
                     "loss_mask": mask, "rollout_logprobs": [-10.0 if m else 0.0 for m in mask],
                     "policy_version": [0 if m else -1 for m in mask],
                     "advantages": [(1.0 if i % 2 else -1.0) if m else 0.0 for m in mask], "reward": float(i % 2)})
    return rows


def molt_side(args: argparse.Namespace, lora: int | None = None) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each timed step of molt.train at world size 1, with adapters of rank ``lora``."""
    from molt.schema import batch_from_rows, make_schema, resolve_fields
    from molt.runtime.stage import StageContext
    from molt.train import ObjectiveConfig, OptimConfig, load_policy, shard_policy, train_step
    from molt.policy import LoraConfig
    from molt.train.moe import freeze_routers, routers
    from molt.train.optim import make_optimizer
    from stages.pack import Pack

    rows = make_rows(args)
    schema = make_schema(resolve_fields(tuple(rows[0]), "bench"), "trajectory")
    pack = Pack(Pack.Config(groups_per_step=1, max_tokens_per_micro_batch=args.rows * args.tokens),
                StageContext("pack"))
    pack.setup()
    batch = pack.place([batch_from_rows(rows, schema)])
    model = load_policy(resolve_model(args.model), TEMPERATURE)
    if lora is not None:
        config = LoraConfig(rank=lora, alpha=2 * lora)
        if routers(model.lm):  # as pipelines/moe_lora.yaml: routers frozen (trained, every refit would be merged)
            freeze_routers(model.lm, "--lora")
            config.target_modules = ["q_proj", "k_proj", "v_proj", "o_proj"]  # the experts are no linears
        model.add_lora(config)
    model = shard_policy(model, args.dtype, args.device)
    optim = OptimConfig(lr=1e-6)
    optimizer = make_optimizer(model, optim)
    return timed(lambda k: train_step(model, optimizer, batch, ObjectiveConfig(), optim, k), args)


def baseline_side(args: argparse.Namespace) -> list[tuple[float, float]]:
    """(wall, CPU) seconds of each timed step of a plain transformers + AdamW loop on a [B, T] batch."""
    from transformers import AutoModelForCausalLM

    rows = make_rows(args)
    model = AutoModelForCausalLM.from_pretrained(resolve_model(args.model), dtype=torch.float32).to(args.device)
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6, weight_decay=0.0)  # as OptimConfig()
    ids = torch.tensor([r["token_ids"] for r in rows], device=args.device)  # [B, T]
    mask = torch.tensor([r["loss_mask"] for r in rows], device=args.device)[:, 1:]
    old = torch.tensor([r["rollout_logprobs"] for r in rows], device=args.device)[:, 1:]
    adv = torch.tensor([r["advantages"] for r in rows], device=args.device)[:, 1:]

    def step(_: int) -> None:
        autocast = torch.autocast(args.device.split(":")[0], dtype=torch.bfloat16, enabled=args.dtype == "bfloat16")
        with autocast:
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids), use_cache=False).logits
        logp = torch.log_softmax(logits[:, :-1].float() / TEMPERATURE, -1).gather(-1, ids[:, 1:, None])[..., 0]
        loss = torch.where(mask, ppo_clip_loss(logp, old, adv, mask).per_token_loss, 0.0).sum() / mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return timed(step, args)


def timed(step, args: argparse.Namespace) -> list[tuple[float, float]]:  # type: ignore[no-untyped-def]
    """(wall seconds, process CPU seconds) of each of ``--steps`` steps after ``--warmup`` steps."""
    for k in range(args.warmup):
        step(k)
    times = []
    for k in range(args.steps):
        start, cpu = time.perf_counter(), time.process_time()
        step(args.warmup + k)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append((time.perf_counter() - start, time.process_time() - cpu))
    return times


def child(side: str, args: argparse.Namespace, queue: mp.Queue) -> None:
    torch.set_num_threads(args.threads)
    if args.lora is not None:  # molt.train against itself: full fine-tuning (baseline) and LoRA (molt)
        times = molt_side(args, args.lora if side == "molt" else None)
    else:
        times = molt_side(args) if side == "molt" else baseline_side(args)
    peak = (torch.cuda.max_memory_allocated() / 2**20 if args.device.startswith("cuda")
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    queue.put((times, peak))


def run(side: str, args: argparse.Namespace) -> tuple[list[tuple[float, float]], float]:
    """([(s, CPU s) per step], peak RSS MiB) of one side in a fresh spawned process."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=child, args=(side, args, queue))
    proc.start()
    while True:  # a child killed (e.g. by the OOM killer) never answers: do not wait forever
        try:
            result = queue.get(timeout=5)
            break
        except queue_module.Empty:
            if not proc.is_alive():
                raise RuntimeError(f"the {side} process died with exit code {proc.exitcode}") from None
    proc.join()
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=128, help="tokens per row")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--device", default="cpu", help="cpu, or cuda (FSDP2 on a one-rank NCCL group)")
    parser.add_argument("--model", default="smollm2-135m-instruct", help="model name or HF folder")
    parser.add_argument("--repeats", type=int, default=2, help="alternate the sides; keep each side's fastest step")
    parser.add_argument("--lora", type=int, default=None, metavar="RANK", help="LoRA (molt) against full (baseline)")
    args = parser.parse_args()
    tokens = args.rows * args.tokens
    steps: dict[str, list[tuple[float, float]]] = {"baseline": [], "molt": []}
    peaks: dict[str, float] = {"baseline": 0.0, "molt": 0.0}
    for _ in range(args.repeats):  # alternating evens out load from other processes on the host
        for side in steps:
            times, peak = run(side, args)
            steps[side] += times
            peaks[side] = max(peaks[side], peak)
    best = {side: min(t[0] for t in times) for side, times in steps.items()}
    label = {"baseline": "full", "molt": "lora"} if args.lora is not None else {side: side for side in steps}
    for side, times in steps.items():
        walls = sorted(t[0] for t in times)
        print(f"{label[side]:8s} {best[side]:7.2f} s/step (median {walls[len(walls) // 2]:.2f}, max {walls[-1]:.2f} "
              f"of {len(walls)})  {tokens / best[side]:7.1f} tok/s  cpu {min(t[1] for t in times):6.2f} s/step  "
              f"peak {'GPU' if args.device.startswith('cuda') else 'RSS'} {peaks[side]:7.0f} MiB")
    ours, base = tokens / best["molt"], tokens / best["baseline"]
    print(f"ratio train {ours / base:.2f} ({label['molt']} {ours:.1f} tok/s / {label['baseline']} {base:.1f} tok/s)")


if __name__ == "__main__":
    main()
