"""``molt eval``: a model, or a run at a policy version, evaluated on tasks on a fresh engine."""

from __future__ import annotations

import asyncio
import copy
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import click
import yaml

from molt.agents import ChatTemplate
from molt.agents.evaluation import EvalTask, EvaluationConfig, evaluate, load_problems
from molt.config import validate
from molt.runtime.pipeline import Pipeline

# A bare --task NAME: the held-out split of a generated task, the test set the project ships.
NAMED_TASKS: dict[str, dict[str, Any]] = {
    "arithmetic": {"task": {"type": "arithmetic", "split": "eval"}},
    "shapes": {"task": {"type": "shapes", "split": "eval"}},
    "gsm8k": {"task": {"type": "gsm8k", "path": "data/gsm8k/test.jsonl"}, "max_new_tokens": 256},
}


@click.command("eval")
@click.argument("target", type=click.Path())
@click.option("--version", type=int, help="a run's policy version (default: the newest)")
@click.option("--task", multiple=True, help="arithmetic, shapes, gsm8k, a pipeline file or a YAML "
              "mapping; repeatable (default: the run's evaluation)")
@click.option("--samples", type=int, help="k samples per problem besides the greedy one")
@click.option("--temperature", type=float, help="of the samples (default: the policy's, else 1)")
@click.option("--num-problems", type=int, help="at most N distinct problems of each task")
@click.option("--engine", type=click.Choice(["vllm", "transformers"]),
              help="default: the evaluation stage's, else vllm")
@click.option("--seed", type=int, default=0, help="the engine's sampling seed")
@click.option("--json", "json_path", help="also write the report to this JSON file")
def command(target: str, version: int | None, task: tuple[str, ...], samples: int | None,
            temperature: float | None, num_problems: int | None, engine: str | None, seed: int,
            json_path: str | None) -> int:
    """Evaluate a model or a run's checkpoint: accuracy, pass@k, maj@k.

    TARGET: a run directory, a model folder or a built-in model name.
    """
    report = eval_report(target, version, task, samples, temperature, num_problems, engine, seed)
    head = "" if report["policy_version"] is None else f" at version {report['policy_version']}"
    head += "" if report["model"] == target else f" ({report['model']})"
    click.echo(f"{target}{head}, {report['engine']} {report['dtype']}")
    for name, values in report["tasks"].items():
        sampled = (f", {values['samples']} samples at temperature {values['temperature']:g}"
                   if values["samples"] > 1 else "")
        click.echo(f"{name}: {values['num_problems']} problems{sampled}, {values['seconds']:.1f} s")
        for key, value in values.items():
            if f"{key}_stderr" in values:
                click.echo(f"  {key:<12} {value:.4f} ± {values[f'{key}_stderr']:.4f}")
    if json_path:
        Path(json_path).write_text(json.dumps(report, indent=1))
    return 0


def evaluation_stages(pipe: Pipeline) -> list[tuple[str, EvaluationConfig, Any]]:
    """(metric prefix, evaluation, engine config) of each evaluation stage and rollout's
    ``evaluate:`` (prefix ``STAGE/eval``) in ``pipe``."""
    found = []
    for sid, n in pipe.stages.items():
        if isinstance(n.config, EvaluationConfig):
            found.append((sid, n.config, getattr(n.config, "engine")))
        elif isinstance(evaluation := getattr(n.config, "evaluate", None), EvaluationConfig):
            found.append((f"{sid}/eval", evaluation, getattr(n.config, "engine")))
    return found


def pipeline_tasks(pipe: Pipeline) -> dict[str, EvalTask]:
    """The tasks of ``pipe``'s evaluations by metric prefix, e.g. ``evaluate/gsm8k``."""
    return {"/".join(filter(None, (prefix, name))): t for prefix, c, _ in evaluation_stages(pipe)
            for name, t in c.evaluations().items()}


def parse_task(option: str) -> tuple[dict[str, EvalTask], Pipeline | None]:
    """The tasks one ``--task`` names, by name, and the pipeline they came from (or None):
    a pipeline file, a name of NAMED_TASKS, or a YAML mapping of EvalTask keys, ``name`` and
    (at the top level too) task keys: ``{type: arithmetic, split: eval, name: small}``.

    Raises:
        ValueError: not YAML, an invalid task, or a pipeline without an evaluation.
    """
    if option.endswith((".yaml", ".yml")):
        pipe = Pipeline.from_yaml(option)
        if not (found := pipeline_tasks(pipe)):
            raise ValueError(f"--task {option}: the pipeline has no evaluation (no evaluation "
                             "stage, no rollout with evaluate:); hint: name a task, e.g. "
                             "--task arithmetic")
        return found, pipe
    try:
        data = yaml.safe_load(option)
    except yaml.YAMLError as e:
        raise ValueError(f"--task {option!r}: not YAML: {e}") from None
    if isinstance(data, str) and data not in NAMED_TASKS:
        raise ValueError(f"--task {option!r}: unknown task; hint: one of {sorted(NAMED_TASKS)}, a "
                         "pipeline file, or a mapping such as '{type: arithmetic, split: eval}'")
    data = copy.deepcopy(NAMED_TASKS[data]) if isinstance(data, str) else data
    if not isinstance(data, dict):
        raise ValueError(f"--task {option!r}: expected a task name, a pipeline file or a YAML "
                         "mapping")
    name = data.pop("name", None)
    if "task" not in data:  # the task's own keys at the top level
        data = {"task": {k: v for k, v in data.items() if k not in EvalTask.model_fields},
                **{k: v for k, v in data.items() if k in EvalTask.model_fields}}
    name = name or (data["task"].get("type", "task") if isinstance(data["task"], dict) else "task")
    return {str(name): validate(EvalTask, data, f"--task {option!r}", ())}, None


def resolve_target(target: str, version: int | None) -> tuple[Path, int | None, Pipeline | None]:
    """(model folder, policy version, the run's pipeline) of ``molt eval TARGET``: a run's
    trainer folder at ``version`` (default: the newest), else a model folder or name.

    Raises:
        ValueError: no checkpoint at ``version``, or ``version`` given for a model.
    """
    from molt.models import resolve_model
    from molt.runtime.checkpoint import checkpoint_at_version, replica_names, trainer_checkpoints

    run = Path(target)
    if not (run / "pipeline.yaml").is_file():
        if version is not None:
            raise ValueError(f"--version {version}: {target!r} is a model, not a run directory "
                             "(no pipeline.yaml)")
        return resolve_model(target), None, None
    pipe = Pipeline.from_yaml(run / "pipeline.yaml")
    names = replica_names(pipe.checkpointed())
    if version is None and (version := max(trainer_checkpoints(run, names), default=None)) is None:
        raise ValueError(f"{run}: no complete checkpoint holds a trainer's weights; hint: a "
                         "source takes them with checkpoint_every_batches")
    folder, trainer = checkpoint_at_version(run, names, version)
    return folder / trainer, version, pipe


def eval_report(target: str, version: int | None = None, task_options: Sequence[str] = (),
                samples: int | None = None, temperature: float | None = None,
                num_problems: int | None = None, engine_type: str | None = None,
                seed: int = 0) -> dict[str, Any]:
    """What ``molt eval`` reports: ``target`` on each task (default: the run's evaluation) on the
    engine of the evaluation the tasks came from; given arguments replace the tasks' own.

    Raises:
        ValueError: no task, two tasks named alike, a bound broken, or what resolve_target and
            parse_task raise.
    """
    from molt.engines.config import EngineConfig

    for option, value, least in (("--samples", samples, 1), ("--num-problems", num_problems, 1),
                                 ("--temperature", temperature, 1e-9)):
        if value is not None and value < least:
            raise ValueError(f"{option}: takes {'more than 0' if least < 1 else '1 or more'}; "
                             f"got {value}")
    model_dir, version, run = resolve_target(target, version)
    parsed = [parse_task(option) for option in task_options]
    tasks: dict[str, EvalTask] = {}
    for option, (found, _) in zip(task_options, parsed):
        if twice := found.keys() & tasks.keys():
            raise ValueError(f"--task {option}: a task is named {sorted(twice)} already; hint: "
                             "give one a name: key")
        tasks |= found
    if not parsed and run is not None and not (tasks := pipeline_tasks(run)):
        raise ValueError(f"{Path(target, 'pipeline.yaml')}: the run has no evaluation; hint: "
                         "name a task, e.g. --task arithmetic")
    if not tasks:
        raise ValueError(f"molt eval {target}: no task; hint: --task arithmetic, --task gsm8k, "
                         "--task pipelines/quickstart.yaml (its evaluation) or a YAML mapping")
    given = {k: v for k, v in (("samples", samples), ("temperature", temperature)) if v is not None}
    for name, t in tasks.items():
        cut = {"task": t.task.model_copy(update={"num_problems": min(
            num_problems, t.task.num_problems or num_problems)})} if num_problems else {}
        tasks[name] = t.model_copy(update=given | cut)
    # the evaluation the tasks came from: its engine (a checkpoint holds merged weights, not an
    # adapter), policy temperature and tool-call format
    sources = [p for _, p in parsed if p is not None]
    sources = sources or ([run] if run is not None and not parsed else [])
    stated: dict[str, Any] = next((e.model_dump(exclude={"transport", "record_routing", "lora",
                                                         "serve_adapters"})
                                   for p in sources for _, _, e in evaluation_stages(p)), {})
    stated = stated or ({"dtype": run.spec.policy.precision} if run is not None else {})
    engine = EngineConfig.model_validate(stated | ({"type": engine_type} if engine_type else {}))
    policies = [p.spec.policy for p in [*sources, run] if p is not None]
    heat = next((p.temperature for p in policies if p.temperature is not None), 1.0)
    parser = next((p.tool_parser for p in policies if p.tool_parser is not None), "hermes")
    tasks_report = asyncio.run(_evaluate(model_dir, engine, tasks, heat, seed, parser))
    return {"target": target, "model": str(model_dir), "policy_version": version,
            "engine": engine.type, "dtype": engine.dtype, "tasks": tasks_report}


async def _evaluate(model_dir: Path, engine_config: Any, tasks: dict[str, EvalTask],
                    temperature: float, seed: int, tool_parser: str) -> dict[str, dict[str, Any]]:
    """Per task: its metrics on one engine of ``model_dir``, ``num_problems``, ``seconds``,
    ``samples`` and ``temperature`` (the task's, else ``temperature``)."""
    from molt.engines import make_engine

    problems = {name: load_problems(t.task, f"--task {name}") for name, t in tasks.items()}
    chat, report = ChatTemplate.for_model(model_dir, tool_parser, "policy.tool_parser"), {}
    engine = make_engine(engine_config, str(model_dir), "molt eval --engine", 0, seed)
    try:
        for name, t in tasks.items():
            heat = (t.temperature or temperature) if t.samples > 1 else None  # t.temperature > 0
            start = time.monotonic()
            values = await evaluate(engine, chat, problems[name], t.grader,
                                    max_new_tokens=t.max_new_tokens, samples=t.samples,
                                    max_model_len=engine_config.max_model_len,
                                    temperature=heat or 0.0, tag=name, agent=t.agent,
                                    max_turns=t.max_turns)
            report[name] = {**values, "num_problems": len(problems[name]),
                            "seconds": time.monotonic() - start, "samples": t.samples,
                            "temperature": heat}
        return report
    finally:
        engine.close()
