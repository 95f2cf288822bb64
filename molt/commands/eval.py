"""``molt eval``: a model folder, a built-in name or a run directory at a policy version, evaluated on one
or several tasks (molt.agents.evaluation) on a fresh engine; the report as a table and as JSON.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml

from molt.agents import ChatTemplate
from molt.config import validate
from molt.agents.evaluation import EvalTask, EvaluationConfig, evaluate, load_problems
from molt.runtime.pipeline import Pipeline

# A bare --task NAME: the held-out split of a generated task, the test set the project ships.
NAMED_TASKS: dict[str, dict[str, Any]] = {
    "arithmetic": {"task": {"type": "arithmetic", "split": "eval"}},
    "shapes": {"task": {"type": "shapes", "split": "eval"}},
    "gsm8k": {"task": {"type": "gsm8k", "path": "data/gsm8k/test.jsonl"}, "max_new_tokens": 256},
}


def evaluation_stages(pipe: Pipeline) -> list[tuple[str, EvaluationConfig, Any]]:
    """(metric prefix, evaluation, its engine's config) of each evaluation in ``pipe``: an evaluation
    stage's (stages.evaluate; prefix: its stage id) and a rollout's ``evaluate:`` (``STAGE/eval``)."""
    found = []
    for sid, n in pipe.stages.items():
        if isinstance(n.config, EvaluationConfig):
            found.append((sid, n.config, getattr(n.config, "engine")))
        elif isinstance(evaluation := getattr(n.config, "evaluate", None), EvaluationConfig):
            found.append((f"{sid}/eval", evaluation, getattr(n.config, "engine")))
    return found


def pipeline_tasks(pipe: Pipeline) -> dict[str, EvalTask]:
    """The tasks of ``pipe``'s evaluations by their metric prefix: ``evaluate`` (a stage's one ``task``),
    ``evaluate/gsm8k`` (one of its ``tasks``), ``rollout/eval`` (a rollout's)."""
    return {"/".join(filter(None, (prefix, name))): t for prefix, c, _ in evaluation_stages(pipe)
            for name, t in c.evaluations().items()}


def parse_task(option: str) -> tuple[dict[str, EvalTask], Pipeline | None]:
    """The tasks one ``--task`` names, by name, and the pipeline they came from (or None).

    ``option`` is a pipeline file (its evaluation stages' tasks: `pipeline_tasks`), a YAML mapping
    of :class:`EvalTask` keys and ``name`` (default: the task's type) whose task keys may sit at its
    top level (``{type: arithmetic, split: eval, num_problems: 500}``), or a name of :data:`NAMED_TASKS`.

    Raises:
        ValueError: not YAML, an invalid task, or a pipeline without an evaluation stage, naming ``option``.
    """
    if option.endswith((".yaml", ".yml")):
        pipe = Pipeline.from_yaml(option)
        if not (found := pipeline_tasks(pipe)):
            raise ValueError(f"--task {option}: the pipeline has no evaluation (no evaluation stage, no rollout "
                             "with evaluate:); hint: name a task, e.g. --task arithmetic")
        return found, pipe
    try:
        data = yaml.safe_load(option)
    except yaml.YAMLError as e:
        raise ValueError(f"--task {option!r}: not YAML: {e}") from None
    if isinstance(data, str) and data not in NAMED_TASKS:
        raise ValueError(f"--task {option!r}: unknown task; hint: one of {sorted(NAMED_TASKS)}, a pipeline file, "
                         "or a mapping such as '{type: arithmetic, split: eval}'")
    data = copy.deepcopy(NAMED_TASKS[data]) if isinstance(data, str) else data
    if not isinstance(data, dict):
        raise ValueError(f"--task {option!r}: expected a task name, a pipeline file or a YAML mapping")
    name = data.pop("name", None)
    if "task" not in data:  # the task's own keys at the top level
        data = {"task": {k: v for k, v in data.items() if k not in EvalTask.model_fields},
                **{k: v for k, v in data.items() if k in EvalTask.model_fields}}
    name = name or (data["task"].get("type", "task") if isinstance(data["task"], dict) else "task")
    return {str(name): validate(EvalTask, data, f"--task {option!r}", ())}, None


def resolve_target(target: str, version: int | None) -> tuple[Path, int | None, Pipeline | None]:
    """(model folder, policy version, the run's pipeline) of ``molt eval TARGET``.

    A run directory (it holds ``pipeline.yaml``) gives the trainer's weights of its complete checkpoint
    at ``version`` (default: the newest), a Hugging Face folder (molt.train.state); anything else
    is a model folder or built-in name (molt.models.resolve_model), at version None.

    Raises:
        ValueError: no checkpoint at ``version`` (listing those there are), or ``version`` given for a model.
    """
    from molt.runtime.checkpoint import checkpoint_at_version, replica_names, trainer_checkpoints
    from molt.models import resolve_model

    run = Path(target)
    if not (run / "pipeline.yaml").is_file():
        if version is not None:
            raise ValueError(f"--version {version}: {target!r} is a model, not a run directory (no pipeline.yaml)")
        return resolve_model(target), None, None
    pipe = Pipeline.from_yaml(run / "pipeline.yaml")
    names = replica_names(pipe.checkpointed())
    if version is None and (version := max(trainer_checkpoints(run, names), default=None)) is None:
        raise ValueError(f"{run}: no complete checkpoint holds a trainer's weights; hint: a source takes them "
                         "with checkpoint_every_batches")
    folder, trainer = checkpoint_at_version(run, names, version)
    return folder / trainer, version, pipe


async def evaluate_model(model_dir: Path, engine_config: Any, tasks: dict[str, EvalTask], temperature: float = 1.0,
                         seed: int = 0, tool_parser: str = "hermes") -> dict[str, dict[str, Any]]:
    """Start one engine on ``model_dir`` and evaluate it on each task (the module docstring; samples at
    the task's temperature, else ``temperature``; an agent's tool calls read with ``tool_parser``); per task
    name: the metrics with ``num_problems``, ``seconds`` (wall time of that task), ``samples`` and ``temperature``."""
    from molt.engines import make_engine

    problems = {name: load_problems(t.task, f"--task {name}") for name, t in tasks.items()}
    chat, report = ChatTemplate.for_model(model_dir, tool_parser, "policy.tool_parser"), {}
    engine = make_engine(engine_config, str(model_dir), "molt eval --engine", 0, seed)
    try:
        for name, t in tasks.items():
            heat = (temperature if t.temperature is None else t.temperature) if t.samples > 1 else None
            start = time.monotonic()
            values = await evaluate(engine, chat, problems[name], t.grader, max_new_tokens=t.max_new_tokens,
                                    max_model_len=engine_config.max_model_len, samples=t.samples,
                                    temperature=heat or 0.0, tag=name, agent=t.agent, max_turns=t.max_turns)
            report[name] = {**values, "num_problems": len(problems[name]), "seconds": time.monotonic() - start,
                            "samples": t.samples, "temperature": heat}
        return report
    finally:
        engine.close()


def describe(report: dict[str, Any]) -> str:
    """``molt eval``'s table: a header, then per task each metric with its standard error."""
    version = "" if report["policy_version"] is None else f" at version {report['policy_version']}"
    model = "" if report["model"] == report["target"] else f" ({report['model']})"
    lines = [f"{report['target']}{version}{model}, {report['engine']} {report['dtype']}"]
    for name, values in report["tasks"].items():
        sampled = f", {values['samples']} samples at temperature {values['temperature']:g}" if values["samples"] > 1 \
            else ""
        lines.append(f"{name}: {values['num_problems']} problems{sampled}, {values['seconds']:.1f} s")
        lines += [f"  {key:<12} {value:.4f} ± {values[f'{key}_stderr']:.4f}" for key, value in values.items()
                  if f"{key}_stderr" in values]
    return "\n".join(lines)


def eval_report(target: str, version: int | None = None, task_options: Sequence[str] = (),
                samples: int | None = None, temperature: float | None = None, num_problems: int | None = None,
                engine_type: str | None = None, seed: int = 0) -> dict[str, Any]:
    """What ``molt eval`` reports: ``target`` (resolve_target) on each task (parse_task; default: a run's
    evaluation), on the engine of the evaluation stage the tasks came from (a ``--task`` pipeline's or the
    run's: its sizes and precision; else the defaults, in the run's precision), ``engine_type`` replacing
    its type. ``samples``, ``temperature`` and ``num_problems`` replace each task's own when given; a task's
    samples without a temperature take the pipelines' policy temperature, else 1.0, and an agent's tool calls
    are read in their policy's ``tool_parser`` format, else hermes.

    Raises:
        ValueError: no task, two tasks named alike, ``samples`` or ``num_problems`` below 1, or what
            resolve_target and parse_task raise.
    """
    from molt.engines.config import EngineConfig

    for option, value, least in (("--samples", samples, 1), ("--num-problems", num_problems, 1),
                                  ("--temperature", temperature, 1e-9)):
        if value is not None and value < least:
            raise ValueError(f"{option}: takes {'more than 0' if least < 1 else '1 or more'}; got {value}")
    model_dir, version, run = resolve_target(target, version)
    parsed = [parse_task(option) for option in task_options]
    tasks: dict[str, EvalTask] = {}
    for option, (found, _) in zip(task_options, parsed):
        if twice := found.keys() & tasks.keys():
            raise ValueError(f"--task {option}: a task is named {sorted(twice)} already; hint: give one a name: key")
        tasks |= found
    if not parsed and run is not None and not (tasks := pipeline_tasks(run)):
        raise ValueError(f"{Path(target, 'pipeline.yaml')}: the run has no evaluation; hint: name a task, e.g. "
                         "--task arithmetic")
    if not tasks:
        raise ValueError(f"molt eval {target}: no task; hint: --task arithmetic, --task gsm8k, "
                         "--task pipelines/quickstart.yaml (its evaluation) or a YAML mapping")
    given = {"samples": samples, "temperature": temperature}
    tasks = {name: t.model_copy(update={k: v for k, v in given.items() if v is not None} | ({"task": t.task.model_copy(
        update={"num_problems": min(num_problems, t.task.num_problems or num_problems)})} if num_problems else {}))
        for name, t in tasks.items()}
    # the evaluation the tasks came from: its engine (sizes, precision; a checkpoint holds merged weights, not an
    # adapter), policy temperature and tool-call format
    sources = [pipe for _, pipe in parsed if pipe is not None] or ([run] if run is not None and not parsed else [])
    stated: dict[str, Any] = next((engine.model_dump(exclude={"transport", "record_routing", "lora", "serve_adapters"})
                                   for p in sources for _, _, engine in evaluation_stages(p)), {})
    stated = stated or ({"dtype": run.spec.policy.precision} if run is not None else {})
    engine = EngineConfig.model_validate({**stated, **({"type": engine_type} if engine_type else {})})
    policies = [p.spec.policy for p in [*sources, run] if p is not None]
    heat = next((p.temperature for p in policies if p.temperature is not None), 1.0)
    parser = next((p.tool_parser for p in policies if p.tool_parser is not None), "hermes")
    report = asyncio.run(evaluate_model(model_dir, engine, tasks, temperature=heat, seed=seed, tool_parser=parser))
    return {"target": target, "model": str(model_dir), "policy_version": version, "engine": engine.type,
            "dtype": engine.dtype, "tasks": report}
