"""Scoring a policy on held-out problems: greedy accuracy, and pass@k, avg@k, maj@k from k samples.

Used by the evaluation stage (stages.evaluate) and by ``molt eval``. One evaluation of a task:
every problem, one greedy completion (temperature 0) and, with ``samples`` n > 1, n completions at
``temperature``, each graded against the problem's answer (molt.graders). Per problem, with c of its
n samples right (score 1):

    accuracy  the greedy completion's score
    pass@k    1 - C(n - c, k) / C(n, k): the chance that k of the n samples, drawn without
              replacement, hold a right one (the unbiased estimator of Chen et al. 2021,
              arXiv 2107.03374, eq. 1), for k = 1, 2, 4, ... below n, and n
    avg@n     the mean score of the n samples
    maj@n     the score of the answer most samples extracted (self-consistency, Wang et al. 2022,
              arXiv 2203.11171); a tie goes to the answer seen first; a sample without one does not vote

Each is reported as its mean over the N problems with a standard error ``KEY_stderr`` =
sqrt(v / N), v the population variance of the per-problem values (for 0/1 values the binomial
sqrt(p (1 - p) / N)). Example: n = 5, c = 2 -> pass@1 0.4, pass@2 0.7, pass@4 1.0, pass@5 1.0.
"""

from __future__ import annotations

import asyncio
import copy
import math
import statistics
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt.agents import ChatTemplate, SingleTurn, run_episode
from molt.config import validate
from molt.engines.base import Engine, SamplingParams
from molt.graders import Grade, GraderConfig, MathGrader
from molt.metrics import logged_steps
from molt.pipeline import Pipeline
from molt.stage import StageConfig
from molt.tasks import TaskConfig


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one problem: ``n`` samples, ``c`` of them right.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_score(grades: Sequence[Grade]) -> float:
    """The score of the answer extracted most often among ``grades`` (first seen on a tie); 0 if none has one."""
    votes = Counter(g.extracted for g in grades if g.extracted is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    return next(g.score for g in grades if g.extracted is not None and votes[g.extracted] == top)


def sample_ks(n: int) -> list[int]:
    """The k of pass@k reported for ``n`` samples: powers of two below n, and n. Example: 8 -> [1, 2, 4, 8]."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def summarise(per_problem: dict[str, list[float]]) -> dict[str, float]:
    """Each key's mean over problems and ``KEY_stderr`` (sqrt of the population variance over N)."""
    out = {}
    for key, values in per_problem.items():
        out[key] = statistics.fmean(values)
        out[f"{key}_stderr"] = math.sqrt(statistics.pvariance(values) / len(values))
    return out


def sampled_metrics(grades: Sequence[Sequence[Grade]]) -> dict[str, list[float]]:
    """Per-problem pass@k, avg@n and maj@n of each problem's ``n`` graded samples (n > 1, the same for all)."""
    n = len(grades[0])
    rights = [sum(g.score >= 1.0 for g in problem) for problem in grades]
    per = {f"pass@{k}": [pass_at_k(n, c, k) for c in rights] for k in sample_ks(n)}
    per[f"avg@{n}"] = [statistics.fmean(g.score for g in problem) for problem in grades]
    per[f"maj@{n}"] = [majority_score(problem) for problem in grades]
    return per


async def grade_samples(engine: Engine, chat: ChatTemplate, problems: Sequence[dict[str, Any]], grader: Any,
                        params: SamplingParams, samples: int, max_model_len: int, tag: str) -> list[list[Grade]]:
    """``samples`` single-turn completions of every problem, all in flight at once, each graded
    (``grader.grade(text, answer)``); request ids ``{tag}-{problem}.{sample}``. Returns [problem][sample]."""
    async def one(index: int, problem: dict[str, Any], sample: int) -> Grade:
        episode = await run_episode(engine, chat, SingleTurn(), problem, params, f"{tag}-{index}.{sample}", 1,
                                    max_model_len)
        grade: Grade = grader.grade(episode.completion_text, str(problem["answer"]))
        return grade

    flat = await asyncio.gather(*(one(i, p, s) for i, p in enumerate(problems) for s in range(samples)))
    return [flat[i * samples:(i + 1) * samples] for i in range(len(problems))]


async def evaluate(engine: Engine, chat: ChatTemplate, problems: Sequence[dict[str, Any]], grader: Any, *,
                   max_new_tokens: int, max_model_len: int, samples: int = 1, temperature: float = 0.0,
                   tag: str = "eval") -> dict[str, float]:
    """Greedy ``accuracy`` of the engine's current weights on ``problems`` and, with ``samples`` > 1,
    pass@k, avg@n and maj@n at ``temperature``; each with ``KEY_stderr`` (the module docstring).

    Raises:
        ValueError: no problems, or ``samples`` > 1 at temperature 0 (n copies of the greedy answer).
    """
    if not problems:
        raise ValueError("an evaluation needs at least one problem")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"{samples} samples at temperature {temperature} are one greedy answer {samples} times; "
                         "hint: sample at a temperature > 0, e.g. 0.8")
    greedy = await grade_samples(engine, chat, problems, grader, SamplingParams(temperature=0.0,
                                 max_new_tokens=max_new_tokens), 1, max_model_len, f"{tag}-greedy")
    values = summarise({"accuracy": [g[0].score for g in greedy]})
    if samples > 1:
        params = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens)
        values |= summarise(sampled_metrics(await grade_samples(engine, chat, problems, grader, params, samples,
                                                                max_model_len, f"{tag}-t{temperature:g}")))
    return values


def load_problems(task: Any, where: str) -> list[dict[str, Any]]:
    """Every record of ``task`` (a TaskConfig), for an evaluation.

    Raises:
        ValueError: the task is an endless stream, naming ``where`` (its YAML key or option).
    """
    loaded = task.load()
    if loaded.num_records is None:
        raise ValueError(f"{where}: evaluation needs a finite task; got an endless stream; hint: set "
                         "task.num_problems")
    return [loaded.record(i) for i in range(loaded.num_records)]


def default_grader(data: Any) -> Any:
    """A task config's data with the grader its task type needs when none is given: ``{type: shapes}``
    for the shapes task (count and colour), else the field's default ``{type: math}``."""
    task = data.get("task") if isinstance(data, dict) else None
    kind = task.get("type") if isinstance(task, dict) else getattr(task, "type", None)
    return {**data, "grader": {"type": "shapes"}} if kind == "shapes" and "grader" not in data else data


class EvalTask(BaseModel):
    """One evaluation task: ``{task: {type: gsm8k, path: data/gsm8k/test.jsonl}, max_new_tokens: 256}``."""

    model_config = ConfigDict(extra="forbid")
    task: TaskConfig
    grader: GraderConfig = Field(default_factory=MathGrader,  # type: ignore[assignment]
                                 description="{type: math}, {type: exact} or {type: shapes}")
    max_new_tokens: int = Field(24, ge=1, description="per completion")
    samples: int = Field(1, ge=1, description="k > 1: k samples per problem besides the greedy one (pass@k, avg@k, "
                         "maj@k)")
    temperature: float | None = Field(None, gt=0, description="of the samples (molt eval: default the policy's)")
    every_versions: int | None = Field(None, ge=1, description="in a run: evaluate versions divisible by this "
                                       "(default: the stage's every_versions)")

    _grader_for_task = model_validator(mode="before")(lambda data: default_grader(data))


class EvaluationConfig(StageConfig):
    """What an evaluation stage evaluates: one ``task`` (metrics STAGE/accuracy, ...) or several ``tasks``
    by name, each with its own sampling and interval (STAGE/NAME/accuracy, ...)."""

    task: TaskConfig | None = Field(None, description="one task of held-out problems, e.g. {type: arithmetic, "
                                    "split: eval}")
    tasks: dict[str, EvalTask] = Field(default_factory=dict, description="several by name, each an EvalTask")
    every_versions: int = Field(1, ge=1, description="evaluate versions divisible by this")
    max_new_tokens: int = Field(24, ge=1, description="per completion (of task)")
    grader: GraderConfig = Field(default_factory=MathGrader,  # type: ignore[assignment]
                                 description="of task: {type: math}, {type: exact} or {type: shapes}")

    _grader_for_task = model_validator(mode="before")(lambda data: default_grader(data))

    @model_validator(mode="after")
    def _one_form(self) -> EvaluationConfig:
        if (self.task is None) == (not self.tasks):
            raise ValueError("give task (one) or tasks (several by name), not both or neither")
        if bad := [name for name, t in self.tasks.items() if t.samples > 1 and t.temperature is None]:
            raise ValueError(f"tasks.{bad[0]}: samples > 1 need a temperature; hint: e.g. temperature: 0.8")
        return self

    def evaluations(self) -> dict[str, EvalTask]:
        """Each task by its metric prefix ("" for ``task``, its name for one of ``tasks``), intervals filled."""
        if self.task is not None:
            return {"": EvalTask.model_validate({"task": self.task, "grader": self.grader, "every_versions":
                                                 self.every_versions, "max_new_tokens": self.max_new_tokens})}
        return {name: t.model_copy(update={"every_versions": t.every_versions or self.every_versions})
                for name, t in self.tasks.items()}


def metric_key(prefix: str, key: str) -> str:
    """An evaluation's metric ``key`` for the task of ``prefix`` (`EvaluationConfig.evaluations`)."""
    return f"{prefix}/{key}" if prefix else key


def evaluated_before(run_dir: Path | None, replica: str, prefixes: list[str]) -> dict[str, set[int]]:
    """Per task prefix, the versions evaluation ``replica`` (``STAGE.R``) of a resumed run evaluated up to the
    version of the checkpoint it resumes from (later ones were of weights the resume discards); empty sets
    for a new run."""
    from molt.checkpoint import resumed_version

    if run_dir is None:
        return {prefix: set() for prefix in prefixes}
    upto, stage = resumed_version(run_dir), replica.rsplit(".", 1)[0]
    before = logged_steps(run_dir / "metrics" / f"{replica}.jsonl")
    return {prefix: {v for v in before.get(f"{stage}/{metric_key(prefix, 'accuracy')}", ()) if upto is None or v <= upto}
            for prefix in prefixes}


def task_key(prefix: str) -> str:
    """The config key of the task of ``prefix``: ``task`` or ``tasks.NAME``."""
    return f"tasks.{prefix}" if prefix else "task"


# A bare --task NAME: the held-out split of a generated task, the test set the project ships.
NAMED_TASKS: dict[str, dict[str, Any]] = {
    "arithmetic": {"task": {"type": "arithmetic", "split": "eval"}},
    "shapes": {"task": {"type": "shapes", "split": "eval"}},
    "gsm8k": {"task": {"type": "gsm8k", "path": "data/gsm8k/test.jsonl"}, "max_new_tokens": 256},
}


def evaluation_stages(pipe: Pipeline) -> list[tuple[str, Any]]:
    """(stage id, config) of each evaluation stage of ``pipe`` (its config an `EvaluationConfig` with an
    ``engine``, as stages.evaluate.Evaluate's)."""
    return [(sid, n.config) for sid, n in pipe.stages.items() if isinstance(n.config, EvaluationConfig)]


def pipeline_tasks(pipe: Pipeline) -> dict[str, EvalTask]:
    """The tasks of ``pipe``'s evaluation stages by their metric prefix: ``evaluate`` (a stage's one
    ``task``), ``evaluate/gsm8k`` (one of its ``tasks``)."""
    return {"/".join(filter(None, (sid, name))): t for sid, c in evaluation_stages(pipe)
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
            raise ValueError(f"--task {option}: the pipeline has no evaluation stage (stages.evaluate.Evaluate); "
                             "hint: name a task, e.g. --task arithmetic")
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
    at ``version`` (default: the newest), a Hugging Face folder (molt.train.checkpoint); anything else
    is a model folder or built-in name (molt.models.resolve_model), at version None.

    Raises:
        ValueError: no checkpoint at ``version`` (listing those there are), or ``version`` given for a model.
    """
    from molt.checkpoint import checkpoint_at_version, replica_names, trainer_checkpoints
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


async def evaluate_model(model_dir: Path, engine_config: Any, tasks: dict[str, EvalTask],
                         temperature: float = 1.0, seed: int = 0) -> dict[str, dict[str, Any]]:
    """Start one engine on ``model_dir`` and evaluate it on each task (the module docstring; samples at
    the task's temperature, else ``temperature``); per task name: the metrics with ``num_problems``,
    ``seconds`` (wall time of that task), ``samples`` and ``temperature``."""
    from molt.engines.config import make_engine

    problems = {name: load_problems(t.task, f"--task {name}") for name, t in tasks.items()}
    engine = make_engine(engine_config, str(model_dir), "molt eval --engine", 0, seed)
    try:
        chat, report = ChatTemplate.for_model(model_dir), {}
        for name, t in tasks.items():
            heat = (temperature if t.temperature is None else t.temperature) if t.samples > 1 else None
            start = time.monotonic()
            values = await evaluate(engine, chat, problems[name], t.grader, max_new_tokens=t.max_new_tokens,
                                    max_model_len=engine_config.max_model_len, samples=t.samples,
                                    temperature=heat or 0.0, tag=name)
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
    its type. ``samples``,
    ``temperature`` and ``num_problems`` replace each task's own when given; a task's samples without a
    temperature take the pipelines' policy temperature, else 1.0.

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
        raise ValueError(f"{Path(target, 'pipeline.yaml')}: the run has no evaluation stage; hint: name a task, e.g. "
                         "--task arithmetic")
    if not tasks:
        raise ValueError(f"molt eval {target}: no task; hint: --task arithmetic, --task gsm8k, "
                         "--task pipelines/quickstart.yaml (its evaluation) or a YAML mapping")
    given = {"samples": samples, "temperature": temperature}
    tasks = {name: t.model_copy(update={k: v for k, v in given.items() if v is not None} | ({"task": t.task.model_copy(
        update={"num_problems": min(num_problems, t.task.num_problems or num_problems)})} if num_problems else {}))
        for name, t in tasks.items()}
    # the evaluation the tasks came from: its engine (sizes, precision) and policy temperature; else the defaults
    sources = [pipe for _, pipe in parsed if pipe is not None] or ([run] if run is not None and not parsed else [])
    stated: dict[str, Any] = next((c.engine.model_dump(exclude={"transport", "record_routing"})
                                   for p in sources for _, c in evaluation_stages(p)), {})
    stated = stated or ({"dtype": run.spec.policy.precision} if run is not None else {})
    engine = EngineConfig.model_validate({**stated, **({"type": engine_type} if engine_type else {})})
    policy = next((t for t in (p.spec.policy.temperature for p in [*sources, run] if p) if t is not None), 1.0)
    report = asyncio.run(evaluate_model(model_dir, engine, tasks, temperature=policy, seed=seed))
    return {"target": target, "model": str(model_dir), "policy_version": version, "engine": engine.type,
            "dtype": engine.dtype, "tasks": report}
