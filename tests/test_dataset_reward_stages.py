"""DatasetSource and Reward: exact rows, the resumable cursor, errors, and a real run."""

import json
import re

import pytest

from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import read_batches
from molt.schema import COLUMNS, batch_from_rows, make_schema
from molt.runtime.stage import StageContext
from stages.dataset_source import DatasetSource
from stages.reward import Reward
from tests.conftest import GSM8K_DIR, SINK, run_spec

GSM8K_TEST = GSM8K_DIR / "test.jsonl"
SOURCE = "stages.dataset_source.DatasetSource"
REWARD_IN = make_schema([COLUMNS["sample_id"], COLUMNS["metadata"]], "trajectory")


def source(replica=0, num_replicas=1, **config):
    s = DatasetSource(DatasetSource.Config.model_validate(config), StageContext("source", replica, num_replicas))
    s.setup()
    return s


def rows(batches):
    return [r for b in batches for r in b.to_pylist()]


def test_dataset_source_emits_prompt_id_and_metadata_in_batches():
    s = source(task={"type": "arithmetic", "num_problems": 5, "style": "plain"}, prompts_per_batch=2, shuffle=False)
    batches = list(s.generate())
    assert [b.num_rows for b in batches] == [2, 2, 1]
    assert batches[0].schema.names == ["prompt_id", "metadata"]
    first = batches[0].to_pylist()[0]
    meta = json.loads(first["metadata"])
    assert first["prompt_id"] == "arithmetic-train-s0-0"
    assert meta["answer"] == str(meta["a"] + meta["b"]) and meta["task"] == "arithmetic"
    assert meta["split"] == "train" and meta["epoch"] == 0 and meta["task_prompt_id"] == "arithmetic-train-s0-0"
    assert meta["messages"][0]["content"] == f"What is {meta['a']} + {meta['b']}? Answer with just the number."


def test_dataset_source_gives_later_epochs_new_prompt_ids():
    s = source(task={"type": "arithmetic", "num_problems": 2}, prompts_per_batch=4, num_epochs=2, shuffle=False)
    assert [r["prompt_id"] for r in rows(s.generate())] == [
        "arithmetic-train-s0-0", "arithmetic-train-s0-1", "arithmetic-train-s0-0~e1", "arithmetic-train-s0-1~e1"]


@pytest.mark.parametrize("k", [0, 1, 4, 7])
def test_a_restored_cursor_continues_exactly_where_the_saved_one_stopped(k):
    config = {"task": {"type": "gsm8k", "path": str(GSM8K_TEST)}, "prompts_per_batch": 64, "num_epochs": 2,
              "seed": 11}
    full = rows(source(**config).generate())
    assert len(full) == 2 * 1319 and len({r["prompt_id"] for r in full}) == 2 * 1319
    first = source(**config)
    stream = first.generate()
    head = rows(next(stream) for _ in range(k))
    state = json.loads(json.dumps(first.state_dict()))  # what a checkpoint stores
    second = DatasetSource(DatasetSource.Config.model_validate(config), StageContext("source"))
    second.load_state_dict(state)  # before setup(), as on a restart
    second.setup()
    assert head + rows(second.generate()) == full


def test_a_cursor_for_another_task_size_is_refused():
    state = source(task={"type": "arithmetic", "num_problems": 5}).state_dict()
    other = source(task={"type": "arithmetic", "num_problems": 6})
    with pytest.raises(ValueError, match="saved cursor is for 5 records; got a task of 6"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match="state has no 'cursor'"):
        other.load_state_dict({})


def test_replicas_of_the_source_emit_disjoint_shares_of_the_task():
    config = {"task": {"type": "gsm8k", "path": str(GSM8K_TEST)}, "prompts_per_batch": 100}
    shares = [[r["prompt_id"] for r in rows(source(r, 3, **config).generate())] for r in range(3)]
    assert sorted(sum(shares, [])) == sorted(f"gsm8k-test-{i}" for i in range(1319))


def test_an_endless_arithmetic_stream_keeps_going():
    s = source(task={"type": "arithmetic", "num_problems": None}, prompts_per_batch=3)
    stream = s.generate()
    assert sum(next(stream).num_rows for _ in range(50)) == 150


def reward_batch(metas, ids=None):
    ids = ids or [f"s{i}" for i in range(len(metas))]
    return batch_from_rows([{"sample_id": i, "metadata": json.dumps(m)} for i, m in zip(ids, metas)], REWARD_IN)


def reward_stage(**config):
    s = Reward(Reward.Config.model_validate(config), StageContext("reward"))
    s.setup()
    return s


def test_reward_scores_completions_against_the_answer():
    batch = reward_batch([{"answer": "57", "completion_text": "It is 57."},
                          {"answer": "12", "completion_text": "no idea"},
                          {"answer": "1234", "completion_text": "#### 1,234"},
                          {"answer": "5", "completion_text": "I think 3 then 5"}])
    out = reward_stage().process(batch)
    assert out.column("score").to_pylist() == [1.0, 0.0, 1.0, 1.0]
    assert out.schema.field("score").type == COLUMNS["score"].type
    assert out.schema.names == ["sample_id", "metadata", "score"]


def test_reward_logs_score_mean_and_the_no_answer_fraction(tmp_path):
    from molt.runtime.metrics import MetricsWriter

    s = Reward(Reward.Config(), StageContext("reward", metrics=MetricsWriter(tmp_path / "m.jsonl", "reward", 0)))
    s.setup()
    s.process(reward_batch([{"answer": "57", "completion_text": "It is 57."},
                            {"answer": "12", "completion_text": "no idea"}]))
    s.process(reward_batch([{"answer": "3", "completion_text": "3"}, {"answer": "4", "completion_text": "4"}]))
    s.metrics.close()
    lines = [json.loads(line)["values"] for line in (tmp_path / "m.jsonl").read_text().splitlines()]
    assert lines[0] == {"reward/score_mean": 0.5, "reward/no_answer_fraction": 0.5}
    assert lines[1] == {"reward/score_mean": 0.75, "reward/no_answer_fraction": 0.25}, "over the whole run"


def test_reward_names_the_sample_and_the_missing_key():
    with pytest.raises(ValueError, match=re.escape("sample_id 'b-1': metadata has no 'completion_text'")):
        reward_stage().process(reward_batch([{"answer": "1", "completion_text": "1"}, {"answer": "1"}],
                                            ids=["a-0", "b-1"]))
    with pytest.raises(ValueError, match=re.escape("sample_id 's0': metadata has no 'answer'")):
        reward_stage().process(reward_batch([{"completion_text": "1"}]))


def test_reward_selects_the_grader_by_type():
    batch = reward_batch([{"answer": "Paris", "completion_text": " paris "}])
    assert reward_stage(grader={"type": "exact", "ignore_case": True}).process(batch).column("score").to_pylist() == [1.0]
    with pytest.raises(ValueError, match="does not match any of the expected tags"):
        Pipeline.from_spec({"stages": {
            "source": {"class": SOURCE, "config": {"task": {"type": "arithmetic"}}},
            "fake": {"class": "tests.doubles.stages.FakeCompletions"},
            "reward": {"class": "stages.reward.Reward", "config": {"grader": {"type": "regex"}}},
            "sink": {"class": SINK}},
            "edges": [{"from": "source", "to": "fake"}, {"from": "fake", "to": "reward"},
                      {"from": "reward", "to": "sink"}]})


def test_dataset_to_reward_runs_through_the_real_runner(tmp_path, no_orphans):
    spec = {"name": "t", "stop_timeout_s": 5, "stages": {
        "source": {"class": SOURCE, "config": {"task": {"type": "arithmetic", "num_problems": 6},
                                               "prompts_per_batch": 4}},
        "fake": {"class": "tests.doubles.stages.FakeCompletions", "config": {"samples_per_prompt": 2}},
        "reward": {"class": "stages.reward.Reward", "config": {"grader": {"type": "math"}}},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "fake"}, {"from": "fake", "to": "reward", "kind": "keyed"},
                  {"from": "reward", "to": "sink", "record": True}]}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary
    out = [r for b in read_batches(tmp_path / "run" / "record" / "reward.out--sink.in") for r in b.to_pylist()]
    assert len(out) == 12 and len({r["sample_id"] for r in out}) == 12
    assert {r["sample_id"]: r["score"] for r in out} == {
        f"arithmetic-train-s0-{i}/{k}": 1.0 - k for i in range(6) for k in range(2)}
    assert summary["metrics"]["sink/rows_in"] == 12 and summary["metrics"]["reward/score_mean"] == 0.5
    assert summary["metrics"]["reward/no_answer_fraction"] == 0.5
