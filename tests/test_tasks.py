"""Tasks: generated arithmetic, GSM8K files, generic JSONL/Parquet readers and the cursor."""

import json
import logging
import re
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml
from pydantic import TypeAdapter, ValidationError

from molt.runtime.pipeline import Pipeline
from molt.tasks import (ArithmeticProblems, ArithmeticTask, JSONLTask, ParquetTask, PromptNode, RecordSet,
                        TaskConfig, final_answer, prompt_batches, read_gsm8k)
from molt.tasks.arithmetic import canonical
from tests.conftest import GSM8K_DIR

GSM8K = GSM8K_DIR


def problems(n, **kw):
    task = ArithmeticProblems(**kw)
    return [task.record(i) for i in range(n)]


def test_arithmetic_is_reproducible_and_depends_on_the_seed():
    assert problems(50, seed=3) == problems(50, seed=3)
    assert problems(50, seed=3) != problems(50, seed=4)


def test_arithmetic_record_has_the_documented_form():
    r = ArithmeticProblems(style="plain").record(0)
    assert set(r) == {"prompt_id", "messages", "answer", "task", "split", "a", "b", "op"}
    assert r["prompt_id"] == "arithmetic-train-s0-0" and r["task"] == "arithmetic" and r["split"] == "train"
    assert r["messages"] == [{"role": "user", "content": f"What is {r['a']} + {r['b']}? Answer with just the number."}]
    assert r["answer"] == str(r["a"] + r["b"])
    word = ArithmeticProblems().record(0)["messages"][0]["content"]
    assert re.fullmatch(r"\w+ has \d+ \w+ and gets \d+ more\. What is \d+ \+ \d+\? Answer with just the number\.", word)


def test_arithmetic_train_and_eval_splits_never_share_a_problem_whatever_the_seed():
    train = {canonical(r["a"], r["op"], r["b"]) for s in (0, 1) for r in problems(1500, seed=s)}
    held_out = {canonical(r["a"], r["op"], r["b"]) for s in (0, 7) for r in problems(300, seed=s, split="eval")}
    assert len(held_out) > 200 and len(train) > 1000
    assert not train & held_out
    assert canonical(42, "+", 17) == canonical(17, "+", 42) == "17+42"


def test_one_rule_splits_a_task_family_whatever_a_task_states():
    """No task's field moves a problem across splits: a task holding out more than another
    would share problems with the other's training split."""
    for fraction in (0.3, 0.1):
        with pytest.raises(ValidationError, match="eval_fraction"):
            ArithmeticTask(split="eval", eval_fraction=fraction)
    evaluated = ArithmeticTask(split="eval", min_operand=10, max_operand=60, num_problems=300, seed=5)
    trained = ArithmeticTask(split="train", min_operand=5, max_operand=70, num_problems=3000, seed=1).load()
    trained_keys = {canonical(r["a"], r["op"], r["b"]) for r in map(trained.record, range(3000))}
    assert not trained_keys & {canonical(r["a"], r["op"], r["b"]) for r in evaluated.distinct()}


def test_arithmetic_respects_operands_and_operations():
    rs = problems(300, operations=("+", "-", "*"), min_operand=2, max_operand=9, seed=1)
    assert {r["op"] for r in rs} == {"+", "-", "*"}
    for r in rs:
        assert 2 <= r["a"] <= 9 and 2 <= r["b"] <= 9
        assert int(r["answer"]) == eval(f"{r['a']} {r['op']} {r['b']}") >= 0


def test_arithmetic_config_checks_the_operand_range_and_builds_an_endless_stream():
    with pytest.raises(ValidationError, match="min_operand must be <= max_operand; got 50 > 10"):
        ArithmeticTask(min_operand=50, max_operand=10)
    assert ArithmeticTask(num_problems=None).load().num_records is None
    with pytest.raises(ValueError, match="no 'eval' problem in 10000 draws"):
        ArithmeticTask(min_operand=1, max_operand=1, split="eval").load().record(0)  # 1+1 is train


def test_gsm8k_final_answer_strips_commas_and_rejects_a_missing_marker():
    assert final_answer("3 * 412 = 1,236\n#### 1,236") == "1236"
    assert final_answer("#### -5") == "-5"
    with pytest.raises(ValueError, match="does not end with '#### <number>'"):
        final_answer("the answer is 5")


def test_the_real_gsm8k_test_file_parses_into_1319_numeric_answers():
    data = read_gsm8k(GSM8K / "test.jsonl")
    assert data.num_records == 1319 and data.skipped == []
    assert all(re.fullmatch(r"-?\d+(\.\d+)?", r["answer"]) for r in data.records)
    first = data.record(0)
    assert first["prompt_id"] == "gsm8k-test-0" and first["answer"] == "18" and first["split"] == "test"
    assert first["messages"][0]["content"].startswith("Janet\u2019s ducks lay 16 eggs per day.")
    assert len({r["prompt_id"] for r in data.records}) == 1319


def write_lines(path: Path, lines: list[bytes]) -> Path:
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


GOOD = json.dumps({"question": "1+1?", "answer": "1+1=2\n#### 2"}).encode()


def test_a_bad_json_line_is_named_by_file_and_line(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [GOOD, GOOD, b'{"question": "x", "answer": ', GOOD])
    with pytest.raises(ValueError, match=re.escape(f"{path}:3: malformed line: bad JSON")):
        read_gsm8k(path)


def test_non_utf8_bytes_and_missing_keys_are_malformed_lines(tmp_path):
    path = write_lines(tmp_path / "g.jsonl", [GOOD, b'{"question": "caf\xe9", "answer": "#### 1"}'])
    with pytest.raises(ValueError, match=re.escape(f"{path}:2: malformed line: not UTF-8")):
        read_gsm8k(path)
    path = write_lines(tmp_path / "h.jsonl", [json.dumps({"question": "q"}).encode()])
    with pytest.raises(ValueError, match=re.escape(f"{path}:1: malformed line: missing string key 'answer'")):
        read_gsm8k(path)


def test_skip_malformed_counts_and_logs_instead_of_losing_lines_silently(tmp_path, caplog):
    path = write_lines(tmp_path / "g.jsonl", [GOOD, b"[1, 2]", b"not json", b"", GOOD, b'{"question": "q", "answer": "5"}'])
    with caplog.at_level(logging.WARNING, logger="molt.tasks.records"):
        data = read_gsm8k(path, skip_malformed=True)
    assert data.num_records == 2 and [r["prompt_id"] for r in data.records] == ["gsm8k-g-0", "gsm8k-g-1"]
    assert [s.split(": malformed")[0] for s in data.skipped] == [f"{path}:2", f"{path}:3", f"{path}:6"]
    assert "skipped 3 malformed line(s)" in caplog.text


def test_a_missing_file_is_a_value_error_naming_it(tmp_path):
    with pytest.raises(ValueError, match="path\n  Value error, no such file; got '.*nope.jsonl'"):
        JSONLTask(path=tmp_path / "nope.jsonl").load()


def test_generic_jsonl_takes_messages_or_prompt_and_keeps_other_fields(tmp_path):
    rows = [{"prompt": "2+2?", "answer": 4, "level": 1},
            {"prompt_id": "x", "messages": [{"role": "user", "content": "hi"}], "answer": "a", "task": "t"}]
    path = write_lines(tmp_path / "qa.jsonl", [json.dumps(r).encode() for r in rows])
    data = JSONLTask(path=path, split="eval").load()
    assert data.records == [
        {"prompt_id": "qa-0", "messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "task": "qa",
         "split": "eval", "level": 1},
        {"prompt_id": "x", "messages": [{"role": "user", "content": "hi"}], "answer": "a", "task": "t", "split": "eval"}]
    bad = write_lines(tmp_path / "bad.jsonl", [json.dumps({"prompt": "p"}).encode()])
    with pytest.raises(ValueError, match=re.escape(f"{bad}:1: malformed line: missing key 'answer'")):
        JSONLTask(path=bad).load()


def test_parquet_reader_builds_the_same_records_and_names_a_bad_row(tmp_path):
    path = tmp_path / "p.parquet"
    pq.write_table(pa.table({"prompt": ["a?", "b?"], "answer": ["1", None]}), path)
    with pytest.raises(ValueError, match=re.escape(f"{path}: row 1: missing key 'answer'")):
        ParquetTask(path=path).load()
    data = ParquetTask(path=path, skip_malformed=True).load()
    assert data.records == [{"prompt_id": "p-0", "messages": [{"role": "user", "content": "a?"}], "answer": "1",
                             "task": "p", "split": "train"}]
    assert len(data.skipped) == 1


def test_task_config_is_selected_by_type():
    adapter = TypeAdapter(TaskConfig)
    assert isinstance(adapter.validate_python({"type": "arithmetic", "seed": 2}), ArithmeticTask)
    with pytest.raises(ValidationError, match="does not match any of the expected tags"):
        adapter.validate_python({"type": "gsm9k", "path": "x"})


def ids(node):
    return [r["i"] for r in node]


def test_cursor_replicas_take_disjoint_shares_that_cover_each_epoch():
    task = RecordSet([{"i": i} for i in range(7)])
    shares = [ids(PromptNode(task, num_epochs=1, seed=5, replica=r, num_replicas=3)) for r in range(3)]
    assert sorted(sum(shares, [])) == list(range(7))
    assert ids(PromptNode(task, num_epochs=2, shuffle=False, replica=1, num_replicas=3)) == [1, 4, 1, 4]


def test_cursor_reshuffles_each_epoch_and_tags_the_epoch():
    task = RecordSet([{"i": i} for i in range(6)])
    out = list(PromptNode(task, num_epochs=2, seed=1))
    first, second = [r["i"] for r in out[:6]], [r["i"] for r in out[6:]]
    assert sorted(first) == sorted(second) == list(range(6)) and first != second
    assert [r["epoch"] for r in out] == [0] * 6 + [1] * 6


def test_cursor_resumes_without_skipping_or_repeating():
    task = RecordSet([{"i": i} for i in range(10)])
    full = [[r["i"] for r in b] for b in prompt_batches(PromptNode(task, num_epochs=2, seed=3), 4)]
    first = prompt_batches(PromptNode(task, num_epochs=2, seed=3), 4)
    head = [[r["i"] for r in next(first)] for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))
    assert state == {"source": {"epoch": 1, "position": 2}}  # 12 records: all of epoch 0, 2 of epoch 1
    second = prompt_batches(PromptNode(task, num_epochs=2, seed=3), 4)
    second.reset(state)
    assert head + [[r["i"] for r in b] for b in second] == full
    assert [len(b) for b in full] == [4, 4, 4, 4, 4]


def test_an_endless_stream_is_split_across_replicas_by_index():
    task = ArithmeticProblems(num_records=None)
    node = PromptNode(task, replica=1, num_replicas=2)
    got = [next(node)["prompt_id"] for _ in range(3)]
    assert got == ["arithmetic-train-s0-1", "arithmetic-train-s0-3", "arithmetic-train-s0-5"]
    with pytest.raises(ValueError, match="dataset cursor state needs integers 'epoch' and 'position'"):
        node.reset({"epoch": 0})


def test_a_file_task_checks_its_path_at_load_and_takes_the_first_n_records():
    from molt.runtime.pipeline import Pipeline

    spec = {"stages": {"source": {"class": "stages.dataset_source.DatasetSource",
                                  "config": {"task": {"type": "gsm8k", "path": "/nonexistent/test.jsonl"}}},
                       "sink": {"class": "stages.metrics_sink.MetricsSink"}},
            "edges": [{"from": "source", "to": "sink"}]}
    with pytest.raises(ValueError, match=r"stages.source.config.task.path: Value error, no such file; got "
                                         r"'/nonexistent/test.jsonl'"):
        Pipeline.from_spec(spec)
    from molt.tasks import GSM8KTask

    task = GSM8KTask(path=GSM8K / "test.jsonl", num_problems=5).load()
    assert task.num_records == 5 and task.record(0)["answer"] == "18"


def test_a_dataset_that_is_empty_or_repeats_a_prompt_id_is_refused_before_anything_starts(tmp_path):
    from click.testing import CliRunner

    from molt.commands import main

    rows = [{"prompt_id": "q1", "prompt": "1+1?", "answer": "2"}, {"prompt_id": "q2", "prompt": "2+2?", "answer": "4"},
            {"prompt_id": "q1", "prompt": "3+3?", "answer": "6"}]
    path = tmp_path / "qa.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    with pytest.raises(ValueError, match=r"qa.jsonl: rows 0 and 2 have the same prompt_id 'q1'; it keys a prompt's"):
        JSONLTask(path=path).load()
    assert JSONLTask(path=path, num_problems=2).load().num_records == 2
    (tmp_path / "empty.jsonl").write_text("not json\n")
    with pytest.raises(ValueError, match=r"empty.jsonl: no records \(1 malformed lines skipped\)"):
        JSONLTask(path=tmp_path / "empty.jsonl", skip_malformed=True).load()
    # molt run and molt sweep check the dataset before any process starts
    task = f"stages.source.config.task={{type: jsonl, path: {path}}}"
    for argv in (["run", "pipelines/quickstart.yaml", "--run-dir", str(tmp_path / "run"), "--set", task],
                 ["sweep", "pipelines/quickstart.yaml", "--seeds", "1", "--out", str(tmp_path / "sw"), "--set", task]):
        done = CliRunner().invoke(main, argv)
        assert done.exit_code == 2
        err = done.stderr
        assert "stages.source.config.task: " in err and "rows 0 and 2 have the same prompt_id 'q1'" in err
    assert not (tmp_path / "run").exists() and not (tmp_path / "sw" / "seed_0").exists()
    evaluation = f"stages.evaluate.config.task={{type: jsonl, path: {path}}}"  # the held-out set too
    done = CliRunner().invoke(main, ["run", "pipelines/quickstart.yaml", "--run-dir", str(tmp_path / "run"), "--set",
                                     evaluation])
    assert done.exit_code == 2
    assert "stages.evaluate.config.task: " in done.stderr and not (tmp_path / "run").exists()
    spec = yaml.safe_load(Path("pipelines/quickstart.yaml").read_text())  # any stage's tasks: a rollout's evaluate:
    spec["stages"]["rollout"]["config"]["evaluate"] = {"tasks": {"qa": {"task": {"type": "jsonl", "path": str(path)}}}}
    spec["edges"] = [{**e, "from": "rollout.out"} if e["from"] == "rollout" else e for e in spec["edges"]] + [
        {"from": "rollout.eval", "to": "eval_sink"}]
    with pytest.raises(ValueError, match=r"stages.rollout.config.evaluate.tasks.qa.task: .*same prompt_id 'q1'"):
        Pipeline.from_spec(spec).preflight()
