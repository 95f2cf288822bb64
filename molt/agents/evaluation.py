"""Scoring a policy on held-out problems: greedy accuracy, and pass@k, avg@k, maj@k from k samples.

An evaluation grades one greedy completion of every problem and, with ``samples`` n > 1, n
completions at ``temperature``. Per problem, with c of its n samples right:

    accuracy  the greedy completion's score
    pass@k    1 - C(n - c, k) / C(n, k), k = 1, 2, 4, ... below n, and n (Chen et al. 2021,
              arXiv 2107.03374, eq. 1)
    avg@n     the mean score of the n samples
    maj@n     the score of the answer most samples gave in the grader's normal form (Wang et
              al. 2022, arXiv 2203.11171); a tie goes to the first seen

Each is the mean over N distinct problems (``num_problems``), with ``KEY_stderr`` =
sqrt(population variance / N).
Example: n = 5, c = 2 -> pass@1 0.4, pass@2 0.7, pass@4 1.0, pass@5 1.0. With ``agent`` each
completion is that ChatAgent's episode, its last reply graded (wrong if the agent raised).
"""

from __future__ import annotations

import asyncio
import logging
import math
import statistics
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import Any

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from molt.agents import AgentError, ChatServer, ChatTemplate, SingleTurn, run_episode
from molt.config import import_class
from molt.engines.base import Engine, SamplingParams
from molt.tasks.graders import Grade, GraderConfig, MathGrader
from molt.runtime.metrics import logged_steps
from molt.schema import batch_from_rows, make_schema
from molt.runtime.stage import StageConfig
from molt.tasks import TaskConfig

log = logging.getLogger(__name__)
EVAL_SCHEMA = make_schema([pa.field(name, type_, metadata={b"doc": doc.encode()})
                           for name, type_, doc in (
    ("policy_version", pa.int32(), "optimizer steps in the evaluated weights"),
    ("accuracy", pa.float64(), "fraction of problems answered right, greedy"),
    ("accuracy_stderr", pa.float64(), "binomial standard error sqrt(p(1-p)/n)"),
    ("num_problems", pa.int64(), "distinct problems evaluated"),
    ("seconds", pa.float64(), "wall time of the evaluation"),
    ("task", pa.string(), "the task's name in tasks; empty for the one task"),
)], "eval")


def _importable_agent(agent: str | None) -> str | None:
    if agent is not None:
        import_class(agent, "agent")  # a typo fails at load
    return agent


def pass_at_k(n: int, c: int, k: int) -> float:
    """Chen et al.'s unbiased pass@k of one problem: ``n`` samples, ``c`` of them right.

    Raises:
        ValueError: unless 0 <= c <= n and 1 <= k <= n.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority_score(grades: Sequence[Grade]) -> float:
    """The score of the answer extracted most often (first seen on a tie); 0 if none has one."""
    votes = Counter(g.extracted for g in grades if g.extracted is not None)
    if not votes:
        return 0.0
    top = max(votes.values())
    return next(g.score for g in grades if g.extracted is not None and votes[g.extracted] == top)


def sample_ks(n: int) -> list[int]:
    """The k of pass@k for ``n`` samples: powers of two below n, and n. 8 -> [1, 2, 4, 8]."""
    return sorted({2 ** i for i in range(n.bit_length()) if 2 ** i < n} | {n})


def summarise(per_problem: dict[str, list[float]]) -> dict[str, float]:
    """Each key's mean over problems and ``KEY_stderr``."""
    out = {}
    for key, values in per_problem.items():
        out[key] = statistics.fmean(values)
        out[f"{key}_stderr"] = math.sqrt(statistics.pvariance(values) / len(values))
    return out


def sampled_metrics(grades: Sequence[Sequence[Grade]]) -> dict[str, list[float]]:
    """Per-problem pass@k, avg@n and maj@n of [problem][sample] grades (n > 1 for all)."""
    n = len(grades[0])
    rights = [sum(g.score >= 1.0 for g in problem) for problem in grades]
    per = {f"pass@{k}": [pass_at_k(n, c, k) for c in rights] for k in sample_ks(n)}
    per[f"avg@{n}"] = [statistics.fmean(g.score for g in problem) for problem in grades]
    per[f"maj@{n}"] = [majority_score(problem) for problem in grades]
    return per


async def grade_samples(engine: Engine, chat: ChatTemplate, problems: Sequence[dict[str, Any]],
                        grader: Any, params: SamplingParams, samples: int, max_model_len: int,
                        tag: str, version: int, agent: str | None = None,
                        max_turns: int = 1) -> list[list[Grade]]:
    """[problem][sample] grades of ``samples`` completions of every problem, all at once.

    Raises:
        RuntimeError: a completion holds tokens of a version other than ``version``.
    """
    agent_cls = import_class(agent, "agent") if agent else None
    server = ChatServer(engine, chat, params, max_turns, max_model_len) if agent_cls else None

    async def one(index: int, problem: dict[str, Any], sample: int) -> Grade:
        rid = f"{tag}-{index}.{sample}"
        try:
            episode = await (server.run_episode(agent_cls(), problem, rid)  # type: ignore[misc]
                             if server and agent_cls else
                             run_episode(engine, chat, SingleTurn(), problem, params, rid, 1,
                                         max_model_len))
        except AgentError:
            return Grade(0.0, None)
        trained = {v for seg in episode.segments
                   for v, m in zip(seg.policy_version, seg.loss_mask) if m}
        if other := trained - {version}:
            raise RuntimeError(f"evaluation {tag}: a completion holds tokens of version "
                               f"{sorted(other)} in an evaluation of version {version}; the "
                               "weights changed during it")
        grade: Grade = grader.grade(episode.completion_text, str(problem["answer"]))
        return grade

    try:
        flat = await asyncio.gather(*(one(i, p, s) for i, p in enumerate(problems)
                                      for s in range(samples)))
    finally:
        if server is not None:
            await server.stop()
    return [flat[i * samples:(i + 1) * samples] for i in range(len(problems))]


async def evaluate(engine: Engine, chat: ChatTemplate, problems: Sequence[dict[str, Any]],
                   grader: Any, *, max_new_tokens: int, max_model_len: int, samples: int = 1,
                   temperature: float = 0.0, tag: str = "eval", version: int | None = None,
                   agent: str | None = None, max_turns: int = 1) -> dict[str, float]:
    """The module docstring's metrics of the engine's ``version`` (default: the current one).

    Raises:
        ValueError: no problems, or ``samples`` > 1 at temperature 0.
        RuntimeError: the weights changed during the evaluation.
    """
    version = engine.policy_version if version is None else version
    if not problems:
        raise ValueError("an evaluation needs at least one problem")
    if samples > 1 and temperature <= 0:
        raise ValueError(f"{samples} samples at temperature {temperature} are one greedy answer "
                         f"{samples} times; hint: sample at a temperature > 0, e.g. 0.8")

    async def graded(temp: float, n: int, name: str) -> list[list[Grade]]:
        params = SamplingParams(temperature=temp, max_new_tokens=max_new_tokens)
        return await grade_samples(engine, chat, problems, grader, params, n, max_model_len, name,
                                   version, agent, max_turns)

    greedy = await graded(0.0, 1, f"{tag}-greedy")
    values = summarise({"accuracy": [g[0].score for g in greedy]})
    if samples > 1:
        sampled = await graded(temperature, samples, f"{tag}-t{temperature:g}")
        values |= summarise(sampled_metrics(sampled))
    return values


def load_problems(task: Any, where: str) -> list[dict[str, Any]]:
    """``task.distinct()`` (a TaskConfig), with a warning if fewer than its ``num_problems``.

    Raises:
        ValueError: as ``task.distinct()``, naming ``where``.
    """
    try:
        problems: list[dict[str, Any]] = task.distinct()
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    if len(problems) < (task.num_problems or 0):
        log.warning("%s.num_problems: %d; the task holds %d distinct problems, all evaluated",
                    where, task.num_problems, len(problems))
    return problems


def default_grader(data: Any) -> Any:
    """A config's data with ``grader: {type: shapes}`` for a shapes task that names no grader."""
    task = data.get("task") if isinstance(data, dict) else None
    kind = task.get("type") if isinstance(task, dict) else getattr(task, "type", None)
    if kind == "shapes" and "grader" not in data:
        return {**data, "grader": {"type": "shapes"}}
    return data


class _Grading(BaseModel):
    """How a task's completions are made and graded."""

    model_config = ConfigDict(extra="forbid")
    grader: GraderConfig = Field(default_factory=MathGrader,  # type: ignore[assignment]
                                 description="{type: math}, {type: exact} or {type: shapes}")
    max_new_tokens: int = Field(24, ge=1, description="per completion")
    agent: str | None = Field(None, description="import path of a ChatAgent to grade")
    max_turns: int = Field(4, ge=1, description="requests per agent episode")

    _agent = field_validator("agent")(_importable_agent)

    _grader_for_task = model_validator(mode="before")(lambda data: default_grader(data))


class EvalTask(_Grading):
    """One evaluation task: ``{task: {type: gsm8k, path: ...}, max_new_tokens: 256}``."""

    task: TaskConfig
    samples: int = Field(1, ge=1, description="k > 1: k samples per problem besides the greedy one")
    temperature: float | None = Field(None, gt=0, description="of the samples (molt eval: default "
                                      "the policy's)")
    every_versions: int | None = Field(None, ge=1, description="in a run: evaluate versions "
                                       "divisible by this (default: the stage's)")


class EvaluationConfig(StageConfig, _Grading):
    """What an evaluation stage evaluates: one ``task`` (metrics STAGE/accuracy, ...), graded as
    the `_Grading` fields say, or several ``tasks`` by name (STAGE/NAME/accuracy, ...)."""

    task: TaskConfig | None = Field(None, description="one task of held-out problems, e.g. "
                                    "{type: arithmetic, split: eval}")
    tasks: dict[str, EvalTask] = Field(default_factory=dict, description="several by name")
    every_versions: int = Field(1, ge=1, description="evaluate versions divisible by this")

    @model_validator(mode="after")
    def _one_form(self) -> EvaluationConfig:
        if (self.task is None) == (not self.tasks):
            raise ValueError("give task (one) or tasks (several by name), not both or neither")
        if bad := [n for n, t in self.tasks.items() if t.samples > 1 and t.temperature is None]:
            raise ValueError(f"tasks.{bad[0]}: samples > 1 need a temperature; hint: e.g. "
                             "temperature: 0.8")
        return self

    def evaluations(self) -> dict[str, EvalTask]:
        """Each task by its metric prefix ("" for ``task``), intervals filled."""
        if self.task is not None:
            keys = ("task", "grader", "every_versions", "max_new_tokens", "agent", "max_turns")
            return {"": EvalTask.model_validate({k: getattr(self, k) for k in keys})}
        return {name: t.model_copy(update={"every_versions": t.every_versions or
                                           self.every_versions}) for name, t in self.tasks.items()}


def metric_key(prefix: str, key: str) -> str:
    return f"{prefix}/{key}" if prefix else key


def evaluated_before(run_dir: Path | None, replica: str,
                     prefixes: list[str]) -> dict[str, set[int]]:
    """Per task prefix, the versions ``replica`` (``STAGE.R``) logged up to the checkpoint the
    run resumes from."""
    from molt.runtime.checkpoint import resumed_version

    if run_dir is None:
        return {prefix: set() for prefix in prefixes}
    upto, stage = resumed_version(run_dir), replica.rsplit(".", 1)[0]
    before = logged_steps(run_dir / "metrics" / f"{replica}.jsonl")
    return {prefix: {v for v in before.get(f"{stage}/{metric_key(prefix, 'accuracy')}", ())
                     if upto is None or v <= upto}
            for prefix in prefixes}


Retrying = Callable[[Callable[[], Awaitable[None]], str], Awaitable[None]]


class Evaluator:
    """The evaluations of one stage on ``stage.engine``; replica 0 only. ``base`` prefixes the
    metric keys; ``port`` gets one EVAL_SCHEMA row per task and evaluation.

    An evaluation runs in the background (`start`), again on a restarted engine (``retrying``).
    Refits wait for it (`refit`), so it is of one version; hence streamed refits are refused.
    """

    def __init__(self, stage: Any, config: EvaluationConfig | None, where: str, port: str,
                 base: str = "", retrying: Retrying | None = None) -> None:
        self.stage, self.port, self.base, self.retrying = stage, port, base, retrying
        self.tasks = config.evaluations() if config is not None and stage.ctx.replica == 0 else {}
        if self.tasks and (transport := stage.config.engine.transport.type) != "shm":
            raise ValueError(f"{where}: an evaluation holds the engine's refits, and "
                             f"engine.transport {transport} refits are streamed: the trainer's "
                             "send would wait for it; hint: an evaluation stage fed by files "
                             "(pipelines/gsm8k_gpu.yaml)")
        self.prefix = {name: "/".join(filter(None, (base, name))) for name in self.tasks}
        self.problems = {name: load_problems(t.task, f"{where}.tasks.{name}" if name else
                                             f"{where}.task") for name, t in self.tasks.items()}
        before = evaluated_before(stage.ctx.run_dir, f"{stage.ctx.stage_id}.{stage.ctx.replica}",
                                  list(self.prefix.values())) if self.tasks else {}
        self.evaluated = {name: before[self.prefix[name]] for name in self.tasks}
        self.task: asyncio.Future[None] | None = None  # the evaluation `start` started
        if self.tasks:
            stage.log.info("%s", "; ".join(
                f"{self.prefix[name] or 'evaluation'}: {len(self.problems[name])} problems, every "
                f"{t.every_versions} versions" for name, t in self.tasks.items()))

    def not_yet(self, version: int, names: Any = None) -> list[str]:
        """Those of ``names`` (default: every task) not evaluated at ``version``."""
        return [name for name in self.tasks
                if (names is None or name in names) and version not in self.evaluated[name]]

    def due(self, version: int) -> list[str]:
        """The tasks with a multiple of ``every_versions`` in (last evaluated, ``version``]."""
        last_due = {name: version - version % (t.every_versions or 1)
                    for name, t in self.tasks.items()}
        return [name for name in self.not_yet(version)
                if last_due[name] > max(self.evaluated[name], default=-1)]

    def start(self, final: bool = False) -> None:
        """Evaluate the engine's version in the background on the tasks `due` (``final``: every
        task `not_yet` evaluated at it)."""
        assert self.task is None or self.task.done(), "one evaluation at a time"
        if names := (self.not_yet if final else self.due)(self.stage.engine.policy_version):
            run = self.retrying or (lambda attempt, _: attempt())
            self.task = asyncio.ensure_future(run(lambda: self.run(names), "evaluations_retried"))

    async def refit(self, refit: Callable[[], Awaitable[float | None]], wait: bool) -> float | None:
        """``await refit()`` once no evaluation runs, then `start` those due; while one runs,
        None at once unless ``wait``."""
        if self.task is not None and not self.task.done() and not wait:
            return None
        await self._ended()
        seconds = await refit()
        self.start()
        return seconds

    async def finish(self) -> None:
        """Let the running evaluation end, then evaluate the last version on every task."""
        await self._ended()
        self.start(final=True)
        await self._ended()

    async def _ended(self) -> None:
        if self.task is not None:
            await self.task  # raises what it raised

    def state_dict(self) -> dict[str, Any]:
        """The versions evaluated whose rows were sent."""
        if not self.tasks:
            return {}
        return {"evaluated": {name: sorted(v) for name, v in self.evaluated.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The versions of `state_dict`, in place of `evaluated_before`'s."""
        for name, versions in state.get("evaluated", {}).items():
            if name in self.evaluated:
                self.evaluated[name] = set(versions)

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()

    async def run(self, names: list[str]) -> None:
        """Evaluate the engine's version on each of ``names`` `not_yet` evaluated: log its
        metrics at step = version and send its row."""
        engine, version = self.stage.engine, self.stage.engine.policy_version
        for name in self.not_yet(version, names):
            t, prefix, start = self.tasks[name], self.prefix[name], time.monotonic()
            values: dict[str, Any] = await evaluate(
                engine, self.stage.chat, self.problems[name], t.grader,
                max_new_tokens=t.max_new_tokens, samples=t.samples,
                max_model_len=self.stage.config.engine.max_model_len,
                temperature=t.temperature or 0.0, version=version, agent=t.agent,
                tag=f"eval-v{version}{'-' + name if name else ''}", max_turns=t.max_turns)
            values |= {"num_problems": len(self.problems[name]),
                       "seconds": time.monotonic() - start}
            if not self.evaluated[name]:
                values["accuracy_baseline"] = values["accuracy"]
            self.stage.metrics.log({metric_key(prefix, k): v for k, v in values.items()} | {
                metric_key(self.base, "policy_version"): version}, step=version)
            self.stage.log.info("eval version %d%s: accuracy %.3f +- %.3f (%d problems, %.1fs)",
                                version, f" {prefix}" if prefix else "", values["accuracy"],
                                values["accuracy_stderr"], values["num_problems"],
                                values["seconds"])
            row = {**{k: values[k] for k in EVAL_SCHEMA.names if k in values},
                   "policy_version": version, "task": name}
            await self.stage.send(self.port, batch_from_rows([row], EVAL_SCHEMA))
            self.evaluated[name].add(version)  # after the send, so a checkpoint during it lacks it
