"""Rollout: token-exact multi-turn trajectories, versions, admission control, failures.

Uses the transformers engine (the test double) on a tiny random Llama that carries
SmolLM2's real tokenizer and chat template; the vLLM engine is covered in
tests/test_engines.py and tests/test_rollout_vllm.py.
"""

import asyncio
import json
import re

import pytest
import torch

from molt.agents import ChatTemplate, run_episode
from molt.engines.base import SamplingParams
from molt.engines.hf import TransformersEngine
from molt.runtime.recording import read_batches
from tests.conftest import SINK, run_spec
from tests.doubles.stages import EndlessEnv, ScriptedEnv


class Recording(TransformersEngine):
    """The transformers engine, remembering every completion it returned."""

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.completions = []

    async def generate(self, request_id, prompt_token_ids, params, images=()):
        out = await super().generate(request_id, prompt_token_ids, params, images)
        self.completions.append(out)
        return out


@pytest.fixture(scope="module")
def chat(tiny_chat_model):
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(tiny_chat_model))


def test_a_multi_turn_trajectory_is_exactly_engine_tokens_plus_template_deltas(tiny_chat_model, chat):
    engine = Recording(str(tiny_chat_model))
    params = SamplingParams(temperature=1.0, max_new_tokens=6, seed=3)
    ep = asyncio.run(run_episode(engine, chat, ScriptedEnv(), {"question": "What is 2+2?"}, params, "r0",
                                 max_turns=5, max_total_tokens=400))
    [seg] = ep.segments
    c1, c2, c3 = engine.completions
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 2+2?"}])
    d1 = chat.turn_delta_ids([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                             [{"role": "user", "content": "try again (1)"}], c1.finish_reason == "stop")
    d2 = chat.turn_delta_ids([{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}],
                             [{"role": "user", "content": "try again (2)"}], c2.finish_reason == "stop")
    assert seg.token_ids == prompt + c1.token_ids + d1 + c2.token_ids + d2 + c3.token_ids
    gen = [True] * len(c1.token_ids), [True] * len(c2.token_ids), [True] * len(c3.token_ids)
    assert seg.loss_mask == [False] * len(prompt) + gen[0] + [False] * len(d1) + gen[1] + [False] * len(d2) + gen[2]
    assert seg.rollout_logprobs == ([0.0] * len(prompt) + c1.logprobs + [0.0] * len(d1) + c2.logprobs
                                    + [0.0] * len(d2) + c3.logprobs)
    assert [v for v, m in zip(seg.policy_version, seg.loss_mask) if m] == [0] * sum(seg.loss_mask)
    assert all(v == -1 for v, m in zip(seg.policy_version, seg.loss_mask) if not m)
    assert ep.score == 1.0 and ep.num_turns == 3 and ep.info == {"turns": 3}
    # The SmolLM2 template as shipped (its BOS is <|im_start|>): rendered once, no BOS added twice.
    text = chat.tok.decode(prompt)
    assert text.startswith("<|im_start|>system\n") and text.endswith("<|im_start|>assistant\n")
    assert prompt[0] == chat.tok.bos_token_id != prompt[1]
    closing = "<|im_end|>\n" if c1.finish_reason == "length" else "\n"
    assert chat.tok.decode(d1) == f"{closing}<|im_start|>user\ntry again (1)<|im_end|>\n<|im_start|>assistant\n"


def test_an_env_that_never_ends_is_cut_by_the_turn_budget(tiny_chat_model, chat):
    engine = TransformersEngine(str(tiny_chat_model))
    ep = asyncio.run(run_episode(engine, chat, EndlessEnv(), {"question": "hi"}, SamplingParams(max_new_tokens=3),
                                 "r1", max_turns=4, max_total_tokens=400))
    assert ep.num_turns == 4 and ep.score is None


def test_a_prompt_longer_than_the_context_window_is_refused(tiny_chat_model, chat):
    engine = TransformersEngine(str(tiny_chat_model))
    with pytest.raises(ValueError, match=r"prompt has \d+ tokens; the context window \(max_total_tokens\) is 16"):
        asyncio.run(run_episode(engine, chat, ScriptedEnv(), {"question": "word " * 50}, SamplingParams(),
                                "r2", max_turns=1, max_total_tokens=16))


def rollout_pipeline(model, **rollout):
    return {"name": "ro", "stages": {
        "source": {"class": "stages.dataset_source.DatasetSource",
                   "config": {"task": {"type": "arithmetic", "num_problems": 6}, "prompts_per_batch": 2}},
        "rollout": {"class": "stages.rollout.Rollout",
                    "config": {"model": str(model), "engine": {"type": "transformers"}, "group_size": 3,
                               "max_new_tokens": 6, "seed": 1, **rollout}},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "rollout"}, {"from": "rollout", "to": "sink", "record": True}]}


def test_rollout_only_pipeline_emits_whole_graded_groups(tiny_chat_model, tmp_path, no_orphans):
    spec = rollout_pipeline(tiny_chat_model)
    spec["stages"]["reward"] = {"class": "stages.reward.Reward"}
    spec["edges"] = [{"from": "source", "to": "rollout"}, {"from": "rollout", "to": "reward"},
                     {"from": "reward", "to": "sink", "record": True}]
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    batches = list(read_batches(tmp_path / "run" / "record" / "reward.out--sink.in"))
    assert len(batches) == 6, "one batch per prompt group"
    for b in batches:
        rows = b.to_pylist()
        assert len(rows) == 3 and len({r["prompt_id"] for r in rows}) == 1 and rows[0]["group_size"] == 3
        for r in rows:
            meta = json.loads(r["metadata"])
            assert meta["answer"] and "completion_text" in meta and r["score"] in (0.0, 1.0)
            assert sum(r["loss_mask"]) >= 1 and len(r["token_ids"]) == len(r["policy_version"])
    assert summary["metrics"]["rollout/tokens_generated"] == sum(
        sum(r["loss_mask"]) for b in batches for r in b.to_pylist())


def test_a_failing_env_is_counted_and_no_other_rollout_is_lost(tiny_chat_model, tmp_path, no_orphans):
    spec = rollout_pipeline(tiny_chat_model, env="tests.doubles.stages.FailingEnv", max_turns=3)
    spec["stages"]["source"]["config"]["task"] = {"type": "jsonl", "path": str(tmp_path / "q.jsonl")}
    (tmp_path / "q.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "question": f"q{i}", "answer": "1",
                                                          "messages": [{"role": "user", "content": "hi"}]}) + "\n"
                                              for i in range(4)))
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    rows = [r for b in read_batches(tmp_path / "run" / "record" / "rollout.out--sink.in") for r in b.to_pylist()]
    failed = summary["metrics"]["rollout/rollouts_failed"]
    assert failed >= 1 and len(rows) + failed == 12
    assert all(r["score"] == 1.0 and r["group_size"] == 3 for r in rows)


def test_admission_control_keeps_every_token_within_max_staleness_of_a_slow_trainer(
        tiny_chat_model, tmp_path, no_orphans):
    spec = rollout_pipeline(tiny_chat_model, weights_input=True, max_staleness=0, groups_per_step=2,
                            max_concurrent_groups=4)
    spec["stages"]["trainer"] = {"class": "tests.doubles.stages.SlowTrainer", "config": {
        "groups_per_step": 2, "max_staleness": 0, "weights_path": str(tiny_chat_model / "model.safetensors")}}
    spec["edges"] = [{"from": "source", "to": "rollout.in"}, {"from": "rollout", "to": "trainer"},
                     {"from": "trainer.out", "to": "sink", "record": True},
                     {"from": "trainer.weights", "to": "rollout.weights", "kind": "broadcast", "feedback": True}]
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    batches = list(read_batches(tmp_path / "run" / "record" / "trainer.out--sink.in"))
    versions = [sorted({v for row in b.column("policy_version").to_pylist() for v in row if v >= 0})
                for b in batches]
    assert versions == [[0], [0], [1], [1], [2], [2]], "on-policy: step k trains only version-k tokens"
    assert summary["metrics"]["rollout/refit_seconds"] >= 0


def test_an_empty_prompt_fails_its_rollout_with_a_clear_error(tiny_chat_model, chat):
    from molt.agents import AgentError, SingleTurn

    engine = TransformersEngine(str(tiny_chat_model))
    with pytest.raises(AgentError, match=r"task has neither 'messages' nor 'prompt'"):
        asyncio.run(run_episode(engine, chat, SingleTurn(), {"messages": []}, SamplingParams(), "r3"))


def test_a_corrupted_refit_is_detected_naming_the_tensor(tiny_chat_model, tmp_path):
    """The engine digests what its loader consumed; a record whose digests differ
    (here: the trainer 'exported' a different down_proj) stops the refit."""
    import torch
    from safetensors.torch import load_file, save_file

    from molt.engines.refit import apply_weight_record, file_digests

    weights = load_file(str(tiny_chat_model / "model.safetensors"))
    sent = file_digests(str(tiny_chat_model / "model.safetensors"))
    name = "model.layers.0.mlp.down_proj.weight"
    weights[name] = torch.zeros_like(weights[name])  # what reaches the engine differs from what was sent
    save_file(weights, str(tmp_path / "corrupt.safetensors"))
    record = {"policy_version": 1, "uri": f"file://{tmp_path / 'corrupt.safetensors'}",
              "tensor_names": list(sent), "tensor_digests": list(sent.values())}
    engine = TransformersEngine(str(tiny_chat_model))
    with pytest.raises(RuntimeError, match=rf"refit to version 1 is not verified: 1 tensor\(s\) differ.*{name}"):
        asyncio.run(apply_weight_record(engine, record))
    good = {**record, "uri": f"file://{tiny_chat_model / 'model.safetensors'}", "policy_version": 2}
    assert asyncio.run(apply_weight_record(engine, good)) and engine.policy_version == 2
    assert not asyncio.run(apply_weight_record(engine, {**good, "policy_version": 2})), "an old version is skipped"


def test_an_env_that_neither_ends_nor_replies_fails_its_rollout(tiny_chat_model, chat):
    from molt.agents import AgentError
    from tests.doubles.stages import SilentEnv

    engine = TransformersEngine(str(tiny_chat_model))
    with pytest.raises(AgentError, match=r"env.step returned no observation without ending the episode"):
        asyncio.run(run_episode(engine, chat, SilentEnv(), {"question": "hi"}, SamplingParams(max_new_tokens=2),
                                "r4", max_turns=3))


def test_an_episode_cut_by_max_turns_is_marked(tiny_chat_model, chat):
    engine = TransformersEngine(str(tiny_chat_model))
    ep = asyncio.run(run_episode(engine, chat, ScriptedEnv(), {"question": "hi"}, SamplingParams(max_new_tokens=2),
                                 "r5", max_turns=2))
    assert ep.finish_reason == "length" and ep.info == {"cut_by_max_turns": True}


def test_a_run_where_every_rollout_fails_fails(tiny_chat_model, tmp_path, no_orphans):
    spec = rollout_pipeline(tiny_chat_model, env="tests.doubles.stages.AlwaysFailingEnv", max_turns=2)
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 1 and summary["failed_stage"] == "rollout.0"
    assert "every rollout failed (18, 6 groups lost), e.g. rollout " in summary["error"]


def test_an_env_typo_fails_at_load(tiny_chat_model):
    from molt.runtime.pipeline import Pipeline

    with pytest.raises(ValueError, match=r"stages.rollout.config.env: module 'tests.doubles.stages' has no class "
                                         r"'ScriptedEnvv'; did you mean 'ScriptedEnv'\?"):
        Pipeline.from_spec(rollout_pipeline(tiny_chat_model, env="tests.doubles.stages.ScriptedEnvv"))


def test_groups_are_sent_in_the_order_they_started_whatever_order_they_finish_in():
    """A group's training step is its position in the stream // groups_per_step only if groups leave in order."""
    from molt.agents.admission import GroupAdmission

    admission: GroupAdmission[str] = GroupAdmission(groups_per_step=2, max_staleness=None)
    assert [admission.admit() for _ in range(5)] == [0, 1, 2, 3, 4]
    sent = [g for finished in ([(2, "c")], [(0, "a")], [(3, None), (1, "b")], [(4, "e")])  # group 3: lost
            for g in admission.finish(finished)]
    assert sent == ["a", "b", "c", "e"] and admission.num_released == 5 and not admission.finished
    assert admission.num_lost == 1 and admission.state_dict() == {"num_groups": 5, "num_lost": 1, "num_dropped": {}}


def test_a_lost_group_gives_its_place_in_the_step_to_the_next_admitted_one():
    from molt.agents.admission import GroupAdmission

    admission: GroupAdmission[str] = GroupAdmission(groups_per_step=2, max_staleness=0)
    admission.admit(), admission.admit()
    assert not admission.admissible(version=0)  # groups 0-1 fill step 0; group 2 waits for version 1
    assert admission.finish([(1, None)]) == [] and not admission.admissible(version=0)  # 0 may still be lost
    assert admission.finish([(0, "a")]) == ["a"] and admission.admissible(version=0)  # step 0 needs one more
    admission.admit()
    assert not admission.admissible(version=0) and admission.admissible(version=1)
    resumed: GroupAdmission[str] = GroupAdmission(groups_per_step=2, max_staleness=0)
    resumed.load_state_dict({"num_groups": 3, "num_lost": 1})
    assert not resumed.admissible(version=0) and resumed.admissible(version=1)


def test_a_group_a_filter_dropped_gives_its_place_in_the_step_to_the_next_admitted_one():
    from molt.agents.admission import GroupAdmission

    admission: GroupAdmission[str] = GroupAdmission(groups_per_step=2, max_staleness=0)
    admission.admit(), admission.admit()
    assert admission.finish([(0, "a"), (1, "b")]) == ["a", "b"] and not admission.admissible(version=0)
    admission.set_dropped(filter_replica=0, num_dropped=1)  # "b" never reaches the trainer: step 0 needs one more
    assert admission.admissible(version=0)
    admission.set_dropped(filter_replica=0, num_dropped=0)  # an older notice changes nothing
    assert admission.num_dropped == 1
    admission.set_dropped(filter_replica=1, num_dropped=2)  # another filter replica's count adds to it
    assert admission.num_dropped == 3 and admission.state_dict()["num_dropped"] == {"0": 1, "1": 2}
    resumed: GroupAdmission[str] = GroupAdmission(groups_per_step=2, max_staleness=0)
    resumed.load_state_dict(admission.state_dict())
    assert resumed.num_dropped == 3 and resumed.admissible(version=0)


def test_a_bounded_rollout_hears_of_the_groups_a_filter_drops_and_never_waits_for_ever(
        tiny_chat_model, tmp_path, no_orphans):
    """max_staleness 0, two groups a step, every other group flat: without the drop notices the rollout
    counted a dropped group as trained and waited for version 1, which needs the group it never admits."""
    spec = rollout_pipeline(tiny_chat_model, weights_input=True, drops_input=True, max_staleness=0,
                            groups_per_step=2, max_concurrent_groups=4)
    spec["stages"]["source"]["config"]["task"]["num_problems"] = 8
    spec["stages"]["reward"] = {"class": "tests.doubles.stages.FlatOddGroups"}
    spec["stages"]["filter"] = {"class": "stages.dynamic_sampling.DynamicSampling", "config": {"notify_drops": True}}
    spec["stages"]["trainer"] = {"class": "tests.doubles.stages.SlowTrainer", "config": {
        "groups_per_step": 2, "max_staleness": 0, "weights_path": str(tiny_chat_model / "model.safetensors")}}
    spec["watchdog_s"] = 60
    spec["edges"] = [{"from": "source", "to": "rollout.in"}, {"from": "rollout", "to": "reward"},
                     {"from": "reward", "to": "filter"}, {"from": "filter.out", "to": "trainer"},
                     {"from": "filter.drops", "to": "rollout.drops", "kind": "broadcast", "feedback": True},
                     {"from": "trainer.out", "to": "sink", "record": True},
                     {"from": "trainer.weights", "to": "rollout.weights", "kind": "broadcast", "feedback": True}]
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    batches = list(read_batches(tmp_path / "run" / "record" / "trainer.out--sink.in"))
    indices = [int(b.column("rollout_id")[0].as_py().rsplit("#", 1)[1].split("/")[0]) for b in batches]
    versions = [sorted({v for row in b.column("policy_version").to_pylist() for v in row if v >= 0})
                for b in batches]
    assert indices == [0, 2, 4, 6] and versions == [[0], [0], [1], [1]], "on-policy: the kept groups fill the steps"
    assert summary["metrics"]["filter/groups_dropped"] == 4


def test_a_rollout_whose_groups_all_fail_stops_after_a_steps_worth_not_at_the_end(tiny_chat_model, tmp_path):
    """With a feedback loop the prompts never end (the rollout waits for weights no step will make):
    every rollout of the first groups_per_step groups failing fails the stage at once."""
    spec = rollout_pipeline(tiny_chat_model, env="tests.doubles.stages.AlwaysFailingEnv", max_turns=2)
    spec["stages"]["rollout"]["config"].update(groups_per_step=2, max_concurrent_groups=2)
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 1 and summary["failed_stage"] == "rollout.0"
    assert re.search(r"every rollout failed \(\d+, 2 groups lost\), e\.g\. rollout \S+: ", summary["error"])


class Streaming(TransformersEngine):
    """The transformers engine taking "streamed" records (the bytes in the record's file), as a
    VLLMEngine with a weight transfer takes nccl ones."""

    streams_weights = True

    def __init__(self, *a, **k):
        super().__init__(*a, **k)
        self.received = []

    async def receive_weights(self, record):
        self.received.append(record["policy_version"])
        await self.load_weights(record["uri"].removeprefix("file://"), record["policy_version"])


class Inbox:
    """An input port fed from a list: batches, then None (end of stream)."""

    def __init__(self, items, log, name):
        self.items, self.log, self.name = list(items), log, name

    async def recv(self, timeout_s=None):
        self.log.append(f"recv {self.name}")
        return self.items.pop(0)

    async def drain_nowait(self):
        pass

    def latest(self):  # as the broadcast edge: nothing waiting before the rollout has ended
        return None


class Trainer(Inbox):
    """The trainer's weights: its versions as they come, its end of stream only after the rollout ended ``out``
    (the trainer's last step needs the rollout's last groups)."""

    async def recv(self, timeout_s=None):
        while len(self.items) == 1 and "end out" not in self.log:
            await asyncio.sleep(0.01)
        return await super().recv(timeout_s)


class Outbox:
    def __init__(self, log):
        self.log = log

    async def send(self, batch):
        self.log.append("send out")

    async def send_end(self):
        self.log.append("end out")


def test_a_rollout_streaming_refits_ends_its_output_then_takes_every_version_until_the_broadcast_ends(
        tiny_chat_model, tmp_path, monkeypatch):
    """The trainer's NCCL send of the last versions waits for every engine: a rollout whose engine
    streams weights must end ``out`` (so the last step can train) and keep taking versions."""
    import pyarrow as pa

    import stages.rollout as rollout_stage
    from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
    from molt.runtime.stage import StageContext
    from molt.train.model import export_names, load_policy
    from molt.train.publish import publish_weights

    monkeypatch.setattr(rollout_stage, "make_engine", lambda config, model_dir, where, replica, seed, live: Streaming(model_dir))
    model = load_policy(tiny_chat_model, temperature=1.0)
    state = model.state_dict()
    state = {hf: state[name] for name, hf in export_names(model).items()}
    records = [batch_from_rows([{**publish_weights(state, tmp_path / f"v{v}.safetensors", v), "format": "test"}],
                               WEIGHT_VERSION_SCHEMA) for v in (1, 2)]
    prompts = pa.record_batch({"prompt_id": ["p0", "p1"], "metadata": [json.dumps({"prompt": "2+2?"})] * 2})
    log: list[str] = []
    config = rollout_stage.Rollout.Config(model=str(tiny_chat_model), engine={"type": "transformers"}, group_size=2,
                                          max_new_tokens=2, weights_input=True, groups_per_step=2)
    ctx = StageContext("rollout", inputs={"in": Inbox([prompts, None], log, "in"),
                                          "weights": Trainer([*records, None], log, "weights")},
                       outputs={"out": Outbox(log)})
    stage = rollout_stage.Rollout(config, ctx)
    stage.setup()
    asyncio.run(stage.run())
    last = len(log) - 1 - log[::-1].index("recv weights")
    assert log.index("end out") < last, "out ends, then the rollout takes versions until the trainer's end"
    assert log.count("recv weights") == 3 and stage.engine.received == [1, 2] and stage.engine.policy_version == 2
    assert log.count("send out") == 2, "both groups sent"


class Dying(TransformersEngine):
    """An engine whose process dies after ``die_after`` requests: those in flight and all later ones fail."""

    def __init__(self, *a, die_after=3, **k):
        super().__init__(*a, **k)
        self.die_after, self.requests = die_after, 0

    async def _generate(self, request_id, prompt_token_ids, params, images=()):
        self.requests += 1
        await asyncio.sleep(0.01)  # the others are in flight when it dies
        if self.requests > self.die_after:
            await self.break_down(request_id)
        return await super()._generate(request_id, prompt_token_ids, params, images)

    async def break_down(self, request_id):
        from molt.engines.base import EngineDeadError

        raise EngineDeadError(f"request {request_id!r}: the engine core died (a test double)")


class Weights:
    """A broadcast input holding one weight record (as the trainer's latest publication)."""

    def __init__(self, record):
        self.record = record

    async def drain_nowait(self):
        pass

    def latest(self):
        record, self.record = self.record, None
        return record

    async def recv(self, timeout_s=None):  # nothing more comes: the run ends before the trainer does
        if (record := self.latest()) is not None:
            return record
        await asyncio.Event().wait()


def rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts, deaths=1, broken=Dying,
                                hang_s=300.0):
    import pyarrow as pa

    import stages.rollout as rollout_stage
    from molt.schema import WEIGHT_VERSION_SCHEMA, batch_from_rows
    from molt.runtime.stage import StageContext
    from molt.train.model import export_names, load_policy
    from molt.train.publish import publish_weights

    started = []

    def make_engine(config, model_dir, where, replica, seed, live_versions):
        started.append(broken(model_dir) if len(started) < deaths else TransformersEngine(model_dir))
        return started[-1]

    monkeypatch.setattr(rollout_stage, "make_engine", make_engine)
    model = load_policy(tiny_chat_model, temperature=1.0)
    with torch.no_grad():
        model.lm.model.norm.weight.mul_(1.5)
    state = model.state_dict()
    record = batch_from_rows([publish_weights({hf: state[name] for name, hf in export_names(model).items()},
                                              tmp_path / "v1.safetensors", 1, None)], WEIGHT_VERSION_SCHEMA)
    prompts = pa.record_batch({"prompt_id": [f"p{i}" for i in range(4)],
                               "metadata": [json.dumps({"prompt": f"{i}+{i}?"}) for i in range(4)]})
    sent = []
    outbox = Outbox([])
    outbox.send = lambda batch: asyncio.sleep(0, sent.append(batch))
    config = rollout_stage.Rollout.Config(model=str(tiny_chat_model), engine={"type": "transformers"}, group_size=2,
                                          max_new_tokens=3, weights_input=True, groups_per_step=2, max_staleness=1,
                                          max_concurrent_groups=4,
                                          engine_restarts={"max": max_restarts, "hang_s": hang_s})
    ctx = StageContext("rollout", inputs={"in": Inbox([prompts, None], [], "in"), "weights": Weights(record)},
                       outputs={"out": outbox})
    stage = rollout_stage.Rollout(config, ctx)
    stage.setup()
    try:
        asyncio.run(stage.run())
    finally:
        stage.close()
    return stage, started, [r for b in sent for r in b.to_pylist()]


def test_a_dead_engine_is_restarted_at_its_version_and_its_groups_run_again(tiny_chat_model, tmp_path, monkeypatch):
    stage, started, rows = rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts=2)
    assert len(started) == 2 and started[0].requests > 3, "the first engine died, a second took over"
    assert started[1].policy_version == 1, "brought to the dead engine's version by a verified refit"
    assert sorted(r["sample_id"] for r in rows) == sorted({r["sample_id"] for r in rows}) and len(rows) == 8, \
        "every group sent once, whole: nothing lost, nothing twice"
    counters = stage.metrics.counters
    assert counters["engine_restarts"] == 1 and counters["groups_retried"] >= 1
    generated = [v for r in rows for v, m in zip(r["policy_version"], r["loss_mask"]) if m]
    assert generated and set(generated) == {1}, "every token of the new engine carries version 1"


def test_an_engine_dying_more_often_than_allowed_fails_the_rollout_naming_why(tiny_chat_model, tmp_path, monkeypatch):
    with pytest.raises(RuntimeError, match=r"the engine died and is not restarted \(1 deaths within 600 s, over "
                                           r"engine_restarts.max 0\): request .*the engine core died"):
        rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts=0)


class Hanging(Dying):
    """An engine whose core stops (as a SIGSTOPped one) after ``die_after`` requests: those in flight and all
    later ones wait for ever, and nothing fails them."""

    async def break_down(self, request_id):
        await asyncio.Event().wait()


@pytest.mark.timeout(60)  # without the hang check the rollout would wait for ever
def test_a_hung_engine_is_killed_restarted_and_every_group_is_sent_once(tiny_chat_model, tmp_path, monkeypatch):
    stage, started, rows = rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts=2,
                                                       broken=Hanging, hang_s=1.0)
    assert len(started) == 2 and started[0].requests == 8, "all 4 groups x 2 rollouts hung on the first engine"
    assert re.fullmatch(r"the engine hung: no output for [12] s, 8 requests or refits in flight", started[0].killed)
    assert started[0].num_in_flight == 0 and started[1].policy_version == 1
    assert sorted(r["sample_id"] for r in rows) == sorted({r["sample_id"] for r in rows}) and len(rows) == 8
    assert sorted(r["prompt_id"] for r in rows) == ["p0", "p0", "p1", "p1", "p2", "p2", "p3", "p3"]
    counters = stage.metrics.counters
    assert counters["engine_hangs"] == 1 and counters["engine_restarts"] == 1 and counters["groups_retried"] == 4


def test_an_idle_engine_is_never_hung_and_a_busy_silent_one_is_killed(tiny_chat_model):
    import logging

    from molt.engines.base import EngineDeadError
    from molt.engines.restart import EngineRestarter, RestartConfig
    from molt.runtime.metrics import MetricsWriter

    engine = Hanging(str(tiny_chat_model), die_after=0)
    restarter = EngineRestarter(RestartConfig(hang_s=1.0), lambda: engine, logging.getLogger("test"),
                                MetricsWriter(None, "rollout", 0))

    async def main():
        engine.last_output_s -= 1000  # 1000 s since its last output, with nothing in flight
        assert engine.stalled_s() == 0.0 and not restarter.check_hung() and engine.killed is None
        request = asyncio.create_task(engine.generate("r0", [1, 2], SamplingParams(max_new_tokens=2)))
        await asyncio.sleep(0.05)  # in flight, hung; the idle 1000 s before it do not count
        assert engine.num_in_flight == 1 and engine.stalled_s() < 1.0 and not restarter.check_hung()
        engine.last_output_s -= 1000
        assert restarter.check_hung() and not restarter.check_hung(), "killed once"
        with pytest.raises(EngineDeadError, match=r"^request 'r0': the engine hung: no output for 1000 s, 1 "
                                                  r"requests or refits in flight$"):
            await request
        with pytest.raises(EngineDeadError, match=r"^request 'r1': the engine hung"):
            await engine.generate("r1", [1, 2], SamplingParams(max_new_tokens=2))
        assert engine.num_in_flight == 0 and restarter.metrics.counters == {"engine_hangs": 1}

    asyncio.run(main())


class StuckInARefit(TransformersEngine):
    """An engine whose core stops (as a SIGSTOPped one) while it loads weights: the load never returns."""

    async def load_weights(self, path, version):
        await asyncio.Event().wait()


@pytest.mark.timeout(60)  # a refit in flight on a dead engine waited for ever (vLLM never answers its RPC)
def test_an_engine_that_hangs_in_a_refit_is_restarted_with_the_weights_it_was_loading(tiny_chat_model, tmp_path,
                                                                                     monkeypatch):
    stage, started, rows = rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts=2,
                                                       broken=StuckInARefit, hang_s=0.5)
    assert len(started) == 2 and started[0].killed.startswith("the engine hung: no output for")
    assert started[0].policy_version == 0 and started[1].policy_version == 1, "the record it was loading"
    assert len(rows) == 8 and {v for r in rows for v, m in zip(r["policy_version"], r["loss_mask"]) if m} == {1}
    assert stage.metrics.counters["engine_hangs"] == 1 and stage.metrics.counters["engine_restarts"] == 1


@pytest.mark.timeout(60)  # the hang check looked only at the dead engine while its successor hung in its refit
def test_a_new_engine_that_hangs_in_its_first_refit_is_replaced_in_turn(tiny_chat_model, tmp_path, monkeypatch):
    stage, started, rows = rollout_with_a_dying_engine(tiny_chat_model, tmp_path, monkeypatch, max_restarts=2,
                                                       deaths=2, broken=StuckInARefit, hang_s=0.5)
    assert len(started) == 3 and started[1].killed.startswith("the engine hung") and started[2].policy_version == 1
    assert len(rows) == 8 and {v for r in rows for v, m in zip(r["policy_version"], r["loss_mask"]) if m} == {1}
    assert stage.metrics.counters["engine_hangs"] == 2 and stage.metrics.counters["engine_restarts"] == 2


def test_a_barrier_and_the_end_wait_for_every_group_to_be_sent_not_only_finished(tiny_chat_model, monkeypatch):
    """A send may wait for credit after its group was released: a barrier that overtook it would checkpoint
    the group as done and lose it on resume, and the end would cancel the send (the group lost for good)."""
    import pyarrow as pa

    import stages.rollout as rollout_stage
    from molt.runtime.edges import Barrier
    from molt.runtime.stage import StageContext

    log: list[str] = []

    class SlowOutbox(Outbox):
        async def send(self, batch):
            log.append("sending")
            await asyncio.sleep(0.3)  # waiting for credit
            log.append("send out")

    class LateInbox(Inbox):
        """Each item once so many sends have started: the barrier once both groups before it were released
        (the second being sent), the end once the last group is being sent."""

        async def recv(self, timeout_s=None):
            while log.count("sending") < {4: 0, 3: 2, 2: 2, 1: 3}[len(self.items)]:
                await asyncio.sleep(0.01)
            return await super().recv(timeout_s)

    monkeypatch.setattr(rollout_stage, "make_engine", lambda config, model_dir, where, replica, seed, live:
                        TransformersEngine(model_dir))
    prompts = pa.record_batch({"prompt_id": ["p0", "p1"], "metadata": [json.dumps({"prompt": "2+2?"})] * 2})
    config = rollout_stage.Rollout.Config(model=str(tiny_chat_model), engine={"type": "transformers"}, group_size=2,
                                          max_new_tokens=2, groups_per_step=2)
    prompts2 = pa.record_batch({"prompt_id": ["p2"], "metadata": [json.dumps({"prompt": "3+3?"})]})
    ctx = StageContext("rollout", inputs={"in": LateInbox([prompts, Barrier(1), prompts2, None], [], "in")},
                       outputs={"out": SlowOutbox(log)})
    stage = rollout_stage.Rollout(config, ctx)
    stage.setup()

    async def barrier(step):
        log.append("barrier")

    stage.barrier = barrier
    try:
        asyncio.run(stage.run())
    finally:
        stage.close()
    assert log == ["sending", "send out"] * 2 + ["barrier", "sending", "send out"], log
