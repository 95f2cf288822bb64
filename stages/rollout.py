"""Rollout: samples ``group_size`` rollouts per prompt and emits each group whole.

Each prompt on ``in`` becomes ``group_size`` concurrent episodes of the ``env`` or ``agent`` on
one engine, recorded token-exact. Group i starts once the engine is at version
>= i // groups_per_step - max_staleness (molt.agents.admission); groups are sent in the order
they started. Records on ``weights`` are refitted (verified; with streamed weights or
``evaluate:`` also after ``out`` ends). A rollout that raises or whose prompt is over the
context window fails (``rollouts_failed``); a group with none left is lost (``groups_lost``) and
the next takes its place; none succeeding (after a step's worth of lost groups, or at the end)
fails the stage. A dead or hung engine is restarted (molt.engines.restart).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pyarrow as pa
from pydantic import Field

from molt.agents import ChatServer, ChatTemplate, Episode, episode_classes, run_episode, run_group
from molt.agents.admission import GroupAdmission
from molt.runtime.edges import Barrier
from molt.engines.base import SamplingParams
from molt.engines import EngineConfig, make_engine
from molt.engines.restart import EngineRestarter, RestartConfig
from molt.agents.evaluation import EVAL_SCHEMA, EvaluationConfig, Evaluator
from molt.models import resolve_model
from molt.policy import policy_field
from molt.schema import DROP_NOTICE_SCHEMA, batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import Port, Service, StageConfig, first_failure
from molt.tasks import read_prompts

WRITES = ("sample_id", "prompt_id", "rollout_id", "segment_index", "token_ids", "loss_mask",
          "rollout_logprobs", "policy_version", "group_size", "finish_reason", "metadata", "images",
          "image_token_positions")


class Rollout(Service):
    """Prompts in, whole groups of token-exact trajectory rows out."""

    class Config(StageConfig):
        model: str = policy_field("model", "smollm2-135m-instruct")
        engine: EngineConfig = Field(default_factory=EngineConfig)
        group_size: int = Field(4, ge=1, description="rollouts per prompt (n)")
        temperature: float = policy_field("temperature", 1.0, ge=0)
        max_new_tokens: int = Field(256, ge=1, description="per policy turn")
        seed: int | None = Field(None, description="per-request seeds; None = the run's")
        env: str | None = Field(None, description="import path of an Env class; None = SingleTurn")
        agent: str | None = Field(None, description="import path of a ChatAgent (OpenAI SDK) class")
        max_turns: int = Field(1, ge=1, description="policy turns per rollout; more is cut")
        tool_parser: str = policy_field("tool_parser", "hermes")
        max_concurrent_groups: int = Field(8, ge=1)
        max_staleness: int | None = policy_field("max_staleness", None, "at_most", ge=0,
                                                 description="None = unbounded")
        groups_per_step: int = policy_field("groups_per_step", 8, ge=1,
                                            description="per step; each replica paces its share")
        weights_input: bool = Field(False, description="refit to new weights on 'weights'")
        drops_input: bool = Field(False, description="hear of dropped groups on 'drops'")
        engine_restarts: RestartConfig = Field(default_factory=RestartConfig)
        evaluate: EvaluationConfig | None = Field(None, description="evaluations on this engine")

    config: Config

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        assert isinstance(config, cls.Config)
        drops = Port(reads=tuple(DROP_NOTICE_SCHEMA))
        inputs = {"in": Port(reads=("prompt_id", "metadata")),
                  **({"weights": Port()} if config.weights_input else {}),
                  **({"drops": drops} if config.drops_input else {})}
        episode_classes(config.env, config.agent, "stages.rollout.config")  # a typo fails at load
        writes = WRITES + (("score",) if config.env or config.agent else ()) + (
            ("routed_experts",) if config.engine.record_routing else ())
        return inputs, {"out": Port(writes=writes),
                        **({"eval": Port(schema=EVAL_SCHEMA)} if config.evaluate else {})}

    def setup(self) -> None:
        c = self.config
        where, replica = f"stages.{self.ctx.stage_id}.config", self.ctx.replica
        self.env_cls, self.agent_cls = episode_classes(c.env, c.agent, where)
        self.model_dir = resolve_model(c.model)
        self.chat = ChatTemplate.for_model(self.model_dir, c.tool_parser, f"{where}.tool_parser")
        self.restarter = EngineRestarter(c.engine_restarts, lambda: make_engine(
            c.engine, str(self.model_dir), f"{where}.engine", replica, self.ctx.seed_for(replica),
            1 + (c.max_staleness or 1)),  # live versions: at least 2
            self.log, self.metrics, self.ctx.inputs.get("weights"))
        self.engine = self.restarter.engine
        self.evaluator = Evaluator(self, c.evaluate, f"{where}.evaluate", "eval", "eval",
                                   self.restarter.retrying)
        self.params = SamplingParams(temperature=c.temperature, max_new_tokens=c.max_new_tokens,
                                     seed=c.seed)
        self.server = ChatServer(self.engine, self.chat, self.params, c.max_turns,
                                 c.engine.max_model_len, c.max_concurrent_groups * c.group_size
                                 ) if self.agent_cls else None
        self.restarter.holders = [self, *filter(None, [self.server])]  # get a restarted engine
        writes = self.ports(c)[1]["out"].writes
        self.schema = make_schema(resolve_fields(writes, "Rollout"), "trajectory")
        self.admission = GroupAdmission[pa.RecordBatch](
            c.groups_per_step, c.max_staleness, self.ctx.num_replicas,
            f"{where}.groups_per_step (policy.groups_per_step)")
        self.first_failure = ""
        self.first_admit_s: float | None = None
        if (c.env or c.agent) and c.max_turns == 1:
            self.log.warning("max_turns is 1: a multi-turn env or agent ends after its first turn")

    async def run(self) -> None:  # the first task to fail stops the others
        self.finished, self.groups = asyncio.Queue[Any](), set[Any]()  # finished; running
        await self._refit()  # weights already published (a resumed run's) and the first evaluation
        listening = {p: asyncio.create_task(self._listen(p), name=p)
                     for p in ("weights", "drops") if p in self.ctx.inputs}
        others = [asyncio.create_task(self._send_in_order(), name="send"), *listening.values()]
        try:
            await first_failure(asyncio.create_task(self._admit(), name="admit"), others)
            self._check_failures(end=True)
            if "weights" in listening and (self.engine.streams_weights or self.evaluator.tasks):
                await self.end("out")  # a streamed refit waits for every engine
                await first_failure(listening.pop("weights"), [])
        finally:
            for task in others:
                task.cancel()
        await self.evaluator.finish()

    async def _admit(self) -> None:
        """A group per prompt while room and staleness allow; a barrier, and the end, wait until
        every group started was sent."""
        a, room = self.admission, self.config.max_concurrent_groups
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await a.until(lambda: a.drained)
                await self.barrier(item.step)
                continue
            for prompt_id, task in read_prompts(item):
                await a.until(lambda: a.running < room and a.admissible(self.engine.policy_version))
                self.first_admit_s = self.first_admit_s or time.monotonic()
                group = asyncio.create_task(self._group(prompt_id, task, a.admit()))
                self.groups.add(group)  # a reference until it ends
                group.add_done_callback(lambda t: t.cancelled() or self.finished.put_nowait(
                    t.exception() or t.result()))
                group.add_done_callback(self.groups.discard)
        await a.until(lambda: a.drained)

    async def _send_in_order(self) -> None:
        """Send finished groups in admission order (a lost one: nothing); raise a group's error."""
        while True:
            if isinstance(done := await self.finished.get(), BaseException):
                raise done
            lost = self.admission.num_lost
            for batch in self.admission.finish([done]):
                await self.send("out", batch)
            self.admission.sent()
            self.metrics.count("groups_lost", self.admission.num_lost - lost)
            self._check_failures()
            await self.admission.changed()

    async def _listen(self, port: str) -> None:
        while (item := await self.ctx.inputs[port].recv()) is not None:
            if port == "drops" and isinstance(item, pa.RecordBatch):
                self.admission.take_drop_notices(item.to_pylist())
                await self.admission.changed()
            elif port == "weights" and isinstance(item, pa.RecordBatch):
                await self._refit(item)  # or a newer one waiting

    def _check_failures(self, end: bool = False) -> None:
        """Fail when no rollout succeeded (after a step's worth of lost groups, or at the end)."""
        counts, lost = self.metrics.counters, self.admission.num_lost
        if self.first_failure and not counts.get("rows_out") and (
                end or lost >= self.admission.groups_per_step):
            num_failed = counts["rollouts_failed"]
            raise RuntimeError(f"every rollout failed ({num_failed:.0f}, {lost} groups lost), e.g. "
                               f"{self.first_failure}; see the warnings above")
        if end and self.first_admit_s is not None:
            wall = max(time.monotonic() - self.first_admit_s, 1e-9)
            self.metrics.log({"generate_seconds": wall,
                              "generated_tokens_per_s": counts["tokens_generated"] / wall})

    def state_dict(self) -> dict[str, Any]:
        return {**self.admission.state_dict(), **self.evaluator.state_dict(),
                "policy_version": self.engine.policy_version}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.admission.load_state_dict(state)
        self.evaluator.load_state_dict(state)
        self.admission.min_version = state["policy_version"] if self.config.weights_input else 0

    async def _group(self, prompt_id: str, task: dict[str, Any],
                     index: int) -> tuple[int, pa.RecordBatch | None]:
        """Run ``group_size`` episodes of one prompt; (index, rows of the successful ones)."""
        start = time.monotonic()
        rows, failed = await self.restarter.retrying(  # a dead engine: the group runs again
            lambda: run_group(lambda rid: self._episode(task, rid), prompt_id, task, index,
                              self.config.group_size, "score" in self.schema.names))
        for rid, error in failed:
            self.log.warning("rollout %s failed: %s", rid, error)
            self.first_failure = self.first_failure or f"rollout {rid}: {error}"
            self.metrics.count("rollouts_failed")
        self.metrics.count("tokens_generated", sum(sum(r["loss_mask"]) for r in rows))
        self.metrics.log({"group_seconds": time.monotonic() - start,
                          "policy_version": self.engine.policy_version})
        return index, batch_from_rows(rows, self.schema) if rows else None

    async def _episode(self, task: dict[str, Any], rid: str) -> Episode:
        c, server = self.config, self.server
        ep = await (server.run_episode(self.agent_cls(), task, rid) if server  # type: ignore[misc]
                    else run_episode(self.engine, self.chat, self.env_cls(), task, self.params, rid,
                                     c.max_turns, c.engine.max_model_len))
        self.metrics.log(ep.tool_metrics())
        return ep

    async def _refit(self, item: pa.RecordBatch | None = None) -> None:
        """Refit to ``item`` (None: the newest waiting) once no evaluation runs."""
        await self.evaluator.refit(lambda: self.restarter.refit(item), wait=True)
        await self.admission.changed()

    def close(self) -> None:
        parts = (getattr(self, n, None) for n in ("evaluator", "restarter", "server", "engine"))
        for part in filter(None, parts):
            part.close()
