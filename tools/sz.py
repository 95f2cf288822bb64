"""Lines per file and per function of molt/ and stages/, checked against a budget.

Run ``python tools/sz.py``: prints the largest files and functions and exits 1
past the budget. Raise a budget only on purpose, in its own commit, saying why.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

BUDGET_FILE_LINES = 430  # largest single file (from 420: molt/cli.py gains molt eval, issue #34)
BUDGET_FUNCTION_LINES = 60  # largest single function (STYLE: 90th percentile 40-60)
BUDGET_TOTAL_LINES = 17886  # molt/ + stages/ (raised from 9000: checkpoint/resume, refit probes, NCCL refit;
#                            from 10600: mixture-of-experts policies, issue #7; from 11400: routing replay,
#                            issue #8: the worker-side capture, the column through episodes, replay in training;
#                            from 11600: multimodal policies, issue #9: images through messages, engines and the
#                            packed trainer, the VLM builder, SFT records, the shapes task, grader and env;
#                            from 12600: NCCL refits wired into the broadcast, rollout and engine, issue #5;
#                            from 12800: CURVE on tcp:// edges, issue #10: keys, ZAP handler, socket setup;
#                            from 13000: placement backends, issue #10: local processes and Ray launchers;
#                            from 13400: Qwen-VL policies, issue #10: image tokens by resolution, multimodal
#                            RoPE in packed rows, VLMs and checkpoint layouts in the transformers engine;
#                            from 13700: a newcomer's findings: lost prompt groups in admission control
#                            (molt.agents.admission), refit files pinned while loading, clear refusals;
#                            from 13800: per-module learning rates (optim.lr_scale), issue #9;
#                            from 13850, then 14550 (a newcomer's findings: clean refusals of bad arms, seeds
#                            and thresholds): results with their uncertainty, issue #29: the run's seed (molt.seeds),
#                            molt sweep (molt.sweep), molt compare's statistics (molt.stats), sweep plots;
#                            from 14600: learning that holds, issue #30: the pipeline's policy block (molt.policy),
#                            collapse metrics and alarms (molt.train.collapse), pipelines that make the models they need;
#                            from 15050: reliability under faults, issue #35: the janitor of a killed run, the
#                            watchdog with stack dumps, engine restarts (molt.engines.restart), validated frames,
#                            datasets checked before a run starts; to 15500: a newcomer's findings on them: the
#                            evaluation's dataset checked too, Ray-placed stacks, policy facts saved once and validated;
#                            to 15720: issue #35's last items: a group filter's drop notices to a bounded rollout's
#                            admission (molt.agents.admission, stages.dynamic_sampling, molt.policy's check), hung
#                            engines (work in flight on every engine, killed when stalled; a refit in flight on a
#                            dead engine restarts it); to 16250: evaluation as users expect it, issue #34:
#                            molt eval, pass@k/avg@k/maj@k with standard errors (molt.evaluation), several
#                            tasks per evaluation stage and resumed evaluations, stop_when and keep_best (molt.targets);
#                            to 16300: a newcomer's review of them: a resume's discarded evaluations, checkpoints
#                            not yet evaluated spared, targets never logged named, the shapes task's grader;
#                            to 16400: issue #34's evaluation on the rollout's own engine (molt.evaluation.Evaluator,
#                            shared with the evaluation stage; a version check of every evaluated token), molt eval's
#                            command in its own module (molt.eval_command), every task of a stage config preflighted;
#                            to 16450: a newcomer's review of it: evaluated versions in the rollout's checkpoint, tasks
#                            retried alone at one checked version, streamed refits refused, replica 0 evaluates;
#                            to 16950: agents that call tools, issue #31: the Tool contract, tool-call parsers
#                            and tools in chat templates (molt.agents.tools), tool turns in episodes and the
#                            OpenAI endpoint, a bubblewrap sandbox for model-written code (molt.agents.sandbox);
#                            to 17100: the shipped tool-using agent (molt.agents.python_agent, its demonstrations as
#                            SFT rows, evaluations of an agent, policy.tool_parser) and a review's sandbox and
#                            endpoint fixes (read-only root, empty environment, open files, a user id per run;
#                            requests validated naming the field, a full context ended as length);
#                            to 17102: a torchrun group's ranks destroy their process group (CI's gloo abort at exit);
#                            to 17181: molt export (issue #32, item 3), with molt replay's pipelines moved out of
#                            molt/cli.py into molt/replay_command.py (cli.py 423 -> 328 lines); to 17183: molt eval
#                            reads an agent's tool calls in its pipeline's policy.tool_parser format; to 17194: a
#                            newcomer's review: sandbox user ids unique across processes, export's file modes and
#                            provenance; to 17197: an export that fails leaves no partial folder; to 17198: the
#                            model an exported run started from; to 17389: LoRA training, molt.train.lora; to
#                            17416: the sandbox frees a run's user id only once none of its processes is left; to
#                            17777: adapter-only versioned refits, issue #32: the trainer's adapter publication,
#                            vLLM serving one adapter per live version (molt.engines.vllm_lora), the transformers
#                            engine's peft adapters, the merge fallback, adapter folders pinned and linked; to
#                            17789: engine.serve_adapters, merged on CPU where vLLM's LoRA halves generation; to
#                            17822: a VLM adapter merged under its checkpoint names, lr_scale of frozen parameters; to
#                            17852: checkpoints under the folder's names, a stage's session killed at stop, LoRA checks;
#                            17886: vLLM's LoRA support checked before start, a VLM's language model found by structure)
ROOTS = ("molt", "stages")


def functions(path: Path) -> list[tuple[str, int]]:
    tree = ast.parse(path.read_text())
    return [(f"{path}:{n.lineno} {n.name}", n.end_lineno - n.lineno + 1)  # type: ignore[operator]
            for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]


def report(root: Path) -> list[str]:
    """Print the tables; return the budget violations."""
    files = sorted(p for r in ROOTS for p in (root / r).rglob("*.py"))
    sizes = {p.relative_to(root): len(p.read_text().splitlines()) for p in files}
    funcs = [(name.replace(str(root) + "/", ""), n) for p in files for name, n in functions(p)]
    total = sum(sizes.values())
    print(f"{len(files)} files, {total} lines, {len(funcs)} functions")
    for p, n in sorted(sizes.items(), key=lambda kv: -kv[1])[:10]:
        print(f"  {n:5d}  {p}")
    lengths = sorted(n for _, n in funcs)
    if lengths:
        print(f"function lines: median {lengths[len(lengths) // 2]}, "
              f"90th percentile {lengths[int(len(lengths) * 0.9)]}, max {lengths[-1]}")
    for name, n in sorted(funcs, key=lambda kv: -kv[1])[:5]:
        print(f"  {n:5d}  {name}")
    bad = [f"{p}: {n} lines > {BUDGET_FILE_LINES}" for p, n in sizes.items() if n > BUDGET_FILE_LINES]
    bad += [f"{name}: {n} lines > {BUDGET_FUNCTION_LINES}" for name, n in funcs if n > BUDGET_FUNCTION_LINES]
    if total > BUDGET_TOTAL_LINES:
        bad.append(f"total {total} lines > {BUDGET_TOTAL_LINES}")
    return bad


if __name__ == "__main__":
    violations = report(Path(__file__).resolve().parents[1])
    for v in violations:
        print("over budget:", v)
    sys.exit(1 if violations else 0)
