"""The thin stages that apply molt.algorithms to record batches, with exact values."""

import pyarrow as pa
import pytest
import torch

from molt.columns import padded, unpadded
from molt.runtime.pipeline import Pipeline
from molt.schema import COLUMNS, batch_from_rows, make_schema
from molt.runtime.stage import StageContext
from stages.dynamic_sampling import DynamicSampling
from stages.group_advantage import GroupAdvantage
from stages.shape_reward import ShapeReward

COLS = ("sample_id", "prompt_id", "rollout_id", "token_ids", "loss_mask", "finish_reason", "reward")
SCHEMA = make_schema([COLUMNS[c] for c in COLS], "trajectory")


def rows(groups):
    """groups: {prompt: [(reward, num_prompt_tokens, num_generated), ...]}"""
    out = []
    for p, samples in groups.items():
        for k, (reward, n_prompt, n_gen) in enumerate(samples):
            out.append({"sample_id": f"{p}-{k}", "prompt_id": p, "rollout_id": f"{p}-{k}",
                        "token_ids": list(range(n_prompt + n_gen)),
                        "loss_mask": [False] * n_prompt + [True] * n_gen,
                        "finish_reason": "stop", "reward": reward})
    return batch_from_rows(out, SCHEMA)


def stage(cls, **config):
    s = cls(cls.Config.model_validate(config), StageContext(cls.__name__.lower()))
    s.setup()
    return s


def test_padded_and_unpadded_round_trip():
    b = batch_from_rows([{**r, "token_ids": t} for r, t in zip(rows({"p": [(1.0, 1, 1), (0.0, 0, 1)]}).to_pylist(),
                                                             [[1, 2], [3]])], SCHEMA)
    t = padded(b, "token_ids", torch.int64)
    assert t.tolist() == [[1, 2], [3, 0]]
    assert unpadded(t, [2, 1], pa.int32()).to_pylist() == [[1, 2], [3]]


def test_group_advantage_grpo_two_prompts_three_samples():
    b = rows({"a": [(1.0, 2, 2), (0.0, 2, 1), (0.0, 2, 3)], "b": [(1.0, 1, 1)] * 3})
    out = stage(GroupAdvantage).process(b)
    adv = out.column("advantages").to_pylist()
    # group a: mean 1/3, std (Bessel) 0.57735 -> [1.1547, -0.57735, -0.57735]; group b flat -> 0
    assert adv[0] == pytest.approx([0, 0, 1.1547, 1.1547], abs=1e-4)
    assert adv[1] == pytest.approx([0, 0, -0.57735], abs=1e-4)
    assert adv[2][:2] == [0, 0] and adv[2][2:] == pytest.approx([-0.57735] * 3, abs=1e-4)
    assert adv[3:] == [[0.0, 0.0]] * 3
    assert out.schema.names[-1] == "advantages"


def test_group_advantage_selects_rloo_by_yaml_type():
    b = rows({"a": [(1.0, 0, 1), (0.0, 0, 1), (0.0, 0, 1), (0.0, 0, 1)]})
    adv = stage(GroupAdvantage, estimator={"type": "rloo"}).process(b).column("advantages").to_pylist()
    assert [a[0] for a in adv] == pytest.approx([1.0, -1 / 3, -1 / 3, -1 / 3])


def test_group_advantage_refuses_a_null_reward_naming_the_row():
    b = rows({"a": [(1.0, 0, 1), (None, 0, 1)]})
    with pytest.raises(ValueError, match=r"column 'reward' is null in row a-1"):
        stage(GroupAdvantage).process(b)


def test_a_distillation_estimator_needs_teacher_logprobs_at_load(tmp_path):
    spec = {"stages": {
        "source": {"class": "stages.synthetic_source.SyntheticSource"},
        "adv": {"class": "stages.group_advantage.GroupAdvantage", "config": {"estimator": {"type": "distillation"}}},
        "sink": {"class": "stages.metrics_sink.MetricsSink"}},
        "edges": [{"from": "source", "to": "adv"}, {"from": "adv", "to": "sink"}]}
    with pytest.raises(ValueError, match=r"reads column 'teacher_logprobs' which no upstream stage writes"):
        Pipeline.from_spec(spec)
    spec["stages"]["adv"]["config"]["estimator"]["type"] = "grpoo"
    with pytest.raises(ValueError, match=r"stages.adv.config.estimator: Input tag 'grpoo' found using 'type' "
                                         r"does not match any of the expected tags"):
        Pipeline.from_spec(spec)


def test_dynamic_sampling_drops_flat_groups_and_counts_them():
    s = stage(DynamicSampling)
    b = rows({"a": [(1.0, 0, 1), (0.0, 0, 1), (1.0, 0, 1), (1.0, 0, 1)], "b": [(0.0, 0, 1)] * 4})
    out = s.process(b)
    assert out.column("prompt_id").to_pylist() == ["a"] * 4
    assert s.metrics.counters == {"groups_dropped": 1, "groups_kept": 1, "rows_dropped": 4}
    assert s.process(rows({"c": [(0.5, 0, 1)] * 3})) is None


def test_shape_reward_applies_the_overlong_penalty_and_keeps_null_scores():
    schema = make_schema([COLUMNS["score"], COLUMNS["loss_mask"]], "trajectory")
    b = batch_from_rows([{"score": 1.0, "loss_mask": [False] + [True] * 14},
                         {"score": None, "loss_mask": [True]},
                         {"score": 0.0, "loss_mask": [True] * 17}], schema)
    out = stage(ShapeReward, max_new_tokens=16, overlong_buffer_tokens=4).process(b)
    # L=14: (12 - 14) / 4 = -0.5; L=17 > 16: -1
    assert out.column("reward").to_pylist() == [0.5, None, -1.0]


def test_dynamic_sampling_under_a_bounded_staleness_rollout_needs_the_drops_edge_at_load():
    # admission counted a dropped group as trained: without notices max_staleness 0 waited for ever
    import yaml

    data = yaml.safe_load(open("pipelines/quickstart.yaml"))
    data["stages"]["filter"] = {"class": "stages.dynamic_sampling.DynamicSampling"}
    data["edges"] = [e for e in data["edges"] if e != {"from": "shape", "to": "advantage"}] + [
        {"from": "shape", "to": "filter"}, {"from": "filter.out", "to": "advantage"}]
    data["stages"]["rollout"]["config"]["max_staleness"] = 0
    with pytest.raises(ValueError, match=r"stages.filter drops whole groups, downstream of stages.rollout, which "
                                         r"admits groups under stages.rollout.config.max_staleness 0: without "
                                         r"notices .*hint: stages.filter.config.notify_drops: true, "
                                         r"stages.rollout.config.drops_input: true and the edge \{from: "
                                         r"filter.drops, to: rollout.drops, kind: broadcast, feedback: true\}"):
        Pipeline.from_spec(data)
    data["stages"]["filter"]["config"] = {"notify_drops": True}
    data["stages"]["rollout"]["config"]["drops_input"] = True
    data["edges"].append({"from": "filter.drops", "to": "rollout.drops", "feedback": True})  # a stream edge
    with pytest.raises(ValueError, match=r"without notices of the drops"):
        Pipeline.from_spec(data)
    data["edges"][-1]["kind"] = "broadcast"
    assert "filter" in Pipeline.from_spec(data).stages
    data["stages"]["rollout"]["replicas"] = 2
    with pytest.raises(ValueError, match=r"stages.filter drops whole groups made by 2 rollout replicas under a "
                                         r"max_staleness bound \(stages.rollout\): a drop notice does not say"):
        Pipeline.from_spec(data)
    data["stages"]["rollout"]["config"]["max_staleness"] = None
    assert "filter" in Pipeline.from_spec(data).stages


def test_dynamic_sampling_sends_its_running_count_of_drops_and_again_when_resumed():
    import asyncio

    sent = []

    async def send(port, batch):
        sent.append((port, batch.to_pylist()))

    s = stage(DynamicSampling, notify_drops=True)
    s.send, s.ctx.outputs = send, {"out": None, "drops": None}  # ports' stand-ins: send records
    asyncio.run(s.emit(s.process(rows({"a": [(1.0, 0, 1), (0.0, 0, 1)], "b": [(0.0, 0, 1)] * 2}))))
    asyncio.run(s.emit(s.process(rows({"c": [(1.0, 0, 1), (0.0, 0, 1)]}))))  # nothing dropped: no notice
    assert [p for p, _ in sent] == ["out", "drops", "out"]
    assert sent[1] == ("drops", [{"filter_replica": 0, "num_groups_dropped": 1}])
    resumed = stage(DynamicSampling, notify_drops=True)
    resumed.load_state_dict(s.state_dict())
    resumed.send = send

    async def end_of_stream(port):
        return None

    resumed.recv = end_of_stream
    sent.clear()
    asyncio.run(resumed.run())  # sent first: the rollout's checkpoint may predate notice 1
    assert sent == [("drops", [{"filter_replica": 0, "num_groups_dropped": 1}])]
