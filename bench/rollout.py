"""Rollout stage throughput vs vLLM's ``LLM.generate`` on the same prompts, same run.

Baseline: ``vllm.LLM`` (same model, dtype, context, KV cache and eager mode as the
stage's engine) generating ``group_size`` samples of every prompt in one call, token
ids in, with ``logprobs=0`` in processed mode (what the rollout records).
Molt: ``dataset_source -> rollout -> sink`` through the real runner; the rollout
stage reports generated tokens and the seconds from its first admitted group to its
last finished one (engine start-up excluded on both sides).
Target: ratio >= 0.9. Run: ``python bench/rollout.py [--prompts 32 --group-size 4]``.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

from molt.agents import ChatTemplate
from molt.models import resolve_model
from molt.runtime.pipeline import Pipeline
from molt.runtime.runner import Runner
from molt.tasks import ArithmeticProblems


def baseline(model: Path, prompts: list[list[int]], args: argparse.Namespace) -> float:
    """Generated tokens per second of one ``LLM.generate`` call."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(str(model), dtype=args.dtype, max_model_len=args.max_model_len, enforce_eager=True,
              kv_cache_memory_bytes=int(args.kv_cache_gib * 2**30), logprobs_mode="processed_logprobs")
    params = SamplingParams(n=args.group_size, temperature=args.temperature, max_tokens=args.max_new_tokens,
                            logprobs=0, detokenize=False)
    start = time.perf_counter()
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
    seconds = time.perf_counter() - start
    tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    del llm
    return tokens / seconds


def molt_rollout(model: Path, args: argparse.Namespace) -> float:
    """Generated tokens per second reported by the rollout stage."""
    spec = {"name": "bench_rollout", "policy": {"precision": args.dtype, "temperature": args.temperature}, "stages": {
        "source": {"class": "stages.dataset_source.DatasetSource", "config": {
            "task": {"type": "arithmetic", "num_problems": args.prompts, "seed": 0}, "prompts_per_batch": 8,
            "shuffle": False}},
        "rollout": {"class": "stages.rollout.Rollout", "config": {
            "model": str(model), "group_size": args.group_size,
            "max_new_tokens": args.max_new_tokens, "max_concurrent_groups": args.prompts,
            "engine": {"type": "vllm", "max_model_len": args.max_model_len, "kv_cache_gib": args.kv_cache_gib}}},
        "sink": {"class": "stages.metrics_sink.MetricsSink"}},
        "edges": [{"from": "source", "to": "rollout"}, {"from": "rollout", "to": "sink"}]}
    run_dir = Path(tempfile.mkdtemp()) / "run"
    if Runner(Pipeline.from_spec(spec), run_dir, live=False).run() != 0:
        raise SystemExit(f"the molt run failed; see {run_dir}")
    return float(json.loads((run_dir / "summary.json").read_text())["metrics"]["rollout/generated_tokens_per_s"])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--group-size", type=int, default=4)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--max-model-len", type=int, default=1024)
    ap.add_argument("--kv-cache-gib", type=float, default=1.0)
    args = ap.parse_args()
    model = resolve_model("smollm2-135m-instruct")
    from transformers import AutoTokenizer

    chat = ChatTemplate(AutoTokenizer.from_pretrained(model))
    records = ArithmeticProblems(seed=0, num_records=args.prompts, split="train")
    prompts = [chat.prompt_ids(records.record(i)["messages"]) for i in range(args.prompts)]
    base = baseline(model, prompts, args)
    ours = molt_rollout(model, args)
    print(f"LLM.generate {base:.1f} tok/s, molt rollout stage {ours:.1f} tok/s")
    print(f"ratio rollout {ours / base:.2f} (molt {ours:.1f} tok/s / baseline {base:.1f} tok/s)")


if __name__ == "__main__":
    main()
