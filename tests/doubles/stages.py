"""Stage test doubles for the runtime tests (never used by a shipped pipeline)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import time
from typing import ClassVar

import pyarrow as pa
from pydantic import Field

from molt.runtime.edges import Barrier
from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
from molt.runtime.stage import Port, Service, StageConfig, Transform

COUNT_FIELD = pa.field("group_total", pa.int64())


class Boom(Transform):
    """Passes batches through and raises on batch number ``fail_at`` (or in setup)."""

    class Config(StageConfig):
        fail_at: int = 1
        in_setup: bool = False
        kill_self: bool = False

    def setup(self) -> None:
        if self.config.in_setup:
            raise RuntimeError("boom in setup")
        self.seen = 0

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        self.seen += 1
        if self.seen >= self.config.fail_at:
            if self.config.kill_self:
                print(f"SIGKILL to myself at batch {self.seen}", flush=True)
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"boom at batch {self.seen}")
        return batch


class Sleepy(Transform):
    """Sleeps ``sleep_s`` per batch; writes its pid so a test can find it."""

    class Config(StageConfig):
        sleep_s: float = 0.5
        spawn_child: bool = False
        child_session: bool = False  # the child in a session of its own (setsid), as a daemon
        ignore_sigterm: bool = False  # it and its child: only SIGKILL stops them

    def setup(self) -> None:
        assert self.ctx.run_dir is not None
        pids = [os.getpid()]
        if self.config.ignore_sigterm:
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if self.config.spawn_child:  # like an engine process under a stage (SIG_IGN is inherited)
            self.child = subprocess.Popen(["sleep", "300"], start_new_session=self.config.child_session)
            pids.append(self.child.pid)
        (self.ctx.run_dir / f"pids.{self.ctx.stage_id}.{self.ctx.replica}").write_text(json.dumps(pids))

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        time.sleep(self.config.sleep_s)
        return batch


class GroupTotal(Transform):
    """A torchrun-group stage: all ranks see the batch; adds the all-reduced row count."""

    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=(COUNT_FIELD,))}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        import torch
        import torch.distributed as dist

        t = torch.tensor([batch.num_rows], dtype=torch.int64)
        dist.all_reduce(t)  # every rank contributes its copy of the row count
        assert self.ctx.world_size == dist.get_world_size()
        return batch.append_column(COUNT_FIELD, pa.array([int(t)] * batch.num_rows, pa.int64()))


class Actor(Service):
    """Rollout-shaped double: stamps rows with the newest weight version it has seen."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port(), "weights": Port()}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=(pa.field("seen_version", pa.int32()),))}

    async def run(self) -> None:
        version = -1
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            await self.ctx.inputs["weights"].drain_nowait()
            if (w := self.ctx.inputs["weights"].latest()) is not None:
                version = w.column("policy_version")[0].as_py()
            await self.send("out", item.append_column("seen_version", pa.array([version] * item.num_rows, pa.int32())))
            await asyncio.sleep(0.05)


class Learner(Service):
    """Counts batches; after each publishes a weight-version record on ``weights``."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port()}

    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in"),
                                          "weights": Port(schema=WEIGHT_VERSION_SCHEMA)}

    def setup(self) -> None:
        self.version = 0

    async def run(self) -> None:
        while (item := await self.recv("in")) is not None:
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            self.version += 1
            await self.send("out", item)
            await self.send("weights", batch_from_rows([{
                "policy_version": self.version, "uri": "file:///dev/null", "format": "safetensors",
                "num_bytes": 0, "tensor_names": [], "tensor_digests": [], "tensor_dtypes": [], "tensor_shapes": [],
                "probe_token_ids": [], "probe_logprobs": [],
                "probe_atol": None, "created_unix_s": time.time()}],
                WEIGHT_VERSION_SCHEMA))


class Counter(Transform):
    """A sink with state, to test checkpoint barriers."""

    outputs: ClassVar[dict[str, Port]] = {}

    def setup(self) -> None:
        self.rows = 0

    def process(self, batch: pa.RecordBatch) -> None:
        self.rows += batch.num_rows

    def state_dict(self) -> dict:
        return {"rows": self.rows}


class Scorer(Transform):
    """A sink whose state is a trainer's ``version`` (batches seen), logging ``score`` at step = version,
    highest (0) at ``best_version`` (keep_best's tests)."""

    class Config(StageConfig):
        best_version: int = 2

    outputs: ClassVar[dict[str, Port]] = {}

    def setup(self) -> None:
        self.version = 0

    def process(self, batch: pa.RecordBatch) -> None:
        self.version += 1
        self.metrics.log({"score": -abs(self.version - self.config.best_version)}, step=self.version)

    def state_dict(self) -> dict:
        return {"version": self.version}


class ModelMaker(Counter):
    """A sink that, at the end of its input, writes a stand-in model folder (config.json holding
    the rows it saw) where a train stage's ``export_model: name`` would (tests/test_requires.py)."""

    class Config(StageConfig):
        name: str

    def flush(self) -> None:
        from molt.models import export_path

        export_path(self.config.name).mkdir(parents=True)  # a second make would be a bug: it raises
        (export_path(self.config.name) / "config.json").write_text(json.dumps({"rows": self.rows}))


class Placement(Transform):
    """A sink that logs the CPUs it may run on, its OpenMP thread count, its GPU, and
    whether its parent is a Ray actor (molt.runtime.ray's launcher)."""

    outputs: ClassVar[dict[str, Port]] = {}

    def process(self, batch: pa.RecordBatch) -> None:
        import os

        import psutil
        import torch

        parent = " ".join(psutil.Process().parent().cmdline())
        self.metrics.log({"cpus": float(sorted(os.sched_getaffinity(0))[-1]), "num_cpus": len(os.sched_getaffinity(0)),
                          "threads": torch.get_num_threads(), "gpu": int(os.environ.get("CUDA_VISIBLE_DEVICES", -1)),
                          "ray_launcher": float(parent.startswith("ray::Launcher"))})


class NeedsAdvantages(Transform):
    """Reads a column that nothing upstream writes (for the edge-schema check)."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("advantages",))}
    outputs: ClassVar[dict[str, Port]] = {}

    def process(self, batch: pa.RecordBatch) -> None:
        return None


class Knobs(Transform):
    """Has typed config for the YAML error tests."""

    class Config(StageConfig):
        temperature: float = 1.0
        max_new_tokens: int = Field(16, ge=1)

    outputs: ClassVar[dict[str, Port]] = {}

    def process(self, batch: pa.RecordBatch) -> None:
        return None


def weights_json(batch: pa.RecordBatch) -> str:
    return json.dumps(batch.to_pylist())


class FakeCompletions(Transform):
    """Rollout-shaped double for the reward tests: ``samples_per_prompt`` rows per prompt.

    Builds new rows (its output does not pass its input, since ``metadata`` has one
    owner per edge): sample k of prompt p gets ``sample_id`` "p/k" and metadata = the
    prompt's metadata plus ``completion_text`` "The answer is {answer}." for even k,
    "I am not sure." for odd k (so the math grader scores 1, 0, 1, 0, ...).
    """

    class Config(StageConfig):
        samples_per_prompt: int = Field(2, ge=1)

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("prompt_id", "metadata"))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(writes=("sample_id", "prompt_id", "metadata"))}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        from molt.schema import make_schema, resolve_fields

        rows = []
        for prompt in batch.to_pylist():
            meta = json.loads(prompt["metadata"])
            for k in range(self.config.samples_per_prompt):
                text = f"The answer is {meta['answer']}." if k % 2 == 0 else "I am not sure."
                rows.append({"sample_id": f"{prompt['prompt_id']}/{k}", "prompt_id": prompt["prompt_id"],
                             "metadata": json.dumps({**meta, "completion_text": text})})
        schema = make_schema(resolve_fields(("sample_id", "prompt_id", "metadata"), "FakeCompletions"), "trajectory")
        return batch_from_rows(rows, schema)


class ScriptedEnv:
    """A three-turn env: replies 'try again' twice, then ends with reward 1."""

    def __init__(self) -> None:
        self.turns = 0

    def reset(self, task: dict) -> list:
        return [{"role": "user", "content": task["question"]}]

    def step(self, action: str):
        from molt.agents import Result

        self.turns += 1
        if self.turns == 3:
            return Result(reward=1.0, terminated=True, info={"turns": 3})
        return Result(observation=f"try again ({self.turns})")


class FailingEnv(ScriptedEnv):
    """Raises on the first step of every other rollout."""

    count = 0

    def step(self, action: str):
        FailingEnv.count += 1
        if FailingEnv.count % 2:
            raise KeyError("broken tool")
        return super().step(action)


class EndlessEnv(ScriptedEnv):
    """Never terminates."""

    def step(self, action: str):
        from molt.agents import Result

        return Result(observation="more")


class SlowTrainer(Service):
    """Simulated slow trainer: takes ``groups_per_step`` groups per step, checks every
    token's staleness, sleeps, then publishes version k+1 (same weights, real digests)."""

    class Config(StageConfig):
        groups_per_step: int = 2
        max_staleness: int = 0
        step_seconds: float = 0.5
        weights_path: str

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("policy_version", "prompt_id"))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in"), "weights": Port(schema=WEIGHT_VERSION_SCHEMA)}

    async def run(self) -> None:
        from molt.engines.refit import file_digests

        digests = file_digests(self.config.weights_path)
        step, groups = 0, []
        while (item := await self.recv("in")) is not None:
            groups.append(item)
            if len(groups) < self.config.groups_per_step:
                continue
            versions = [v for b in groups for row in b.column("policy_version").to_pylist() for v in row if v >= 0]
            if min(versions) < step - self.config.max_staleness:
                raise RuntimeError(f"step {step}: token version {min(versions)} is too stale")
            for b in groups:
                await self.send("out", b)
            groups, step = [], step + 1
            await asyncio.sleep(self.config.step_seconds)
            await self.send("weights", batch_from_rows([{
                "policy_version": step, "uri": f"file://{self.config.weights_path}", "format": "safetensors",
                "num_bytes": 0, "tensor_names": list(digests), "tensor_digests": list(digests.values()),
                "tensor_dtypes": [], "tensor_shapes": [], "probe_token_ids": [], "probe_logprobs": [], "probe_atol": None,
                "created_unix_s": time.time()}], WEIGHT_VERSION_SCHEMA))
        for b in groups:
            await self.send("out", b)


class HashReward(Transform):
    """Adds ``reward`` = crc32(sample_id) % 2: varied rewards, so GRPO advantages are non-zero."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("sample_id",))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=("reward",))}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        import zlib

        from molt.schema import COLUMNS

        values = [float(zlib.crc32(s.encode()) % 2) for s in batch.column("sample_id").to_pylist()]
        return batch.append_column(COLUMNS["reward"], pa.array(values, pa.float32()))


class SilentEnv(ScriptedEnv):
    """Neither ends the episode nor says anything."""

    def step(self, action: str):
        from molt.agents import Result

        return Result()


class AlwaysFailingEnv(ScriptedEnv):
    def step(self, action: str):
        raise RuntimeError("tool server down")


class LosesPromptOneEnv:
    """Single-turn, reward 1, but every rollout of the second distinct prompt raises: a lost group."""

    seen: ClassVar[dict[str, int]] = {}  # question -> the order it was first seen in (one rollout process)

    def reset(self, task: dict) -> list:
        self.question = str(task["messages"])
        self.seen.setdefault(self.question, len(self.seen))
        return list(task["messages"])

    def step(self, action: str):
        from molt.agents import Result

        if self.seen[self.question] == 1:
            raise RuntimeError("grader down for this prompt")
        return Result(reward=1.0, terminated=True)


class FlatOddGroups(Transform):
    """Adds ``reward``: 0 for every rollout of a group with an odd admission index (flat: a group
    filter drops it), else k % 2 for rollout k (varied). Rollout ids are ``{prompt}#{index}/{k}``."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("rollout_id",))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=("reward",))}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        from molt.schema import COLUMNS

        index_k = [rid.rsplit("#", 1)[1].split("/") for rid in batch.column("rollout_id").to_pylist()]
        values = [0.0 if int(i) % 2 else float(int(k) % 2) for i, k in index_k]
        return batch.append_column(COLUMNS["reward"], pa.array(values, pa.float32()))
