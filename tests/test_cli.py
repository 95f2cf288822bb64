"""The molt command (click): inspect, graph, replay_spec and --set, and how it starts and fails."""

import json
import os
import subprocess
import sys

import pytest
from click.testing import CliRunner

from molt.commands import main
from molt.commands.replay import replay_spec
from molt.runtime.recording import RecordWriter, read_batches, summarize
from molt.schema import COLUMNS, batch_from_rows, make_schema


def _recording(tmp_path):
    schema = make_schema([COLUMNS[c] for c in ("sample_id", "token_ids", "loss_mask", "score")], "trajectory")
    path = tmp_path / "rec" / "x.0.arrow"
    w = RecordWriter(path)
    w.write(batch_from_rows([{"sample_id": "a", "token_ids": [1, 2, 3], "loss_mask": [False, True, True],
                              "score": 1.0}], schema))
    w.close()
    return path


def molt(*args):
    """``molt ARGS`` in this process: the result's exit_code, stdout and stderr."""
    return CliRunner().invoke(main, [str(a) for a in args])


class FakeTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_inspect_prints_rows_columns_docs_and_a_decoded_sample(tmp_path):
    path = _recording(tmp_path)
    done = molt("inspect", path.parent)
    assert done.exit_code == 0, done.output
    out = done.stdout
    assert "1 file(s), 1 rows, 1 batches" in out and "molt.schema_version" in out
    assert "true exactly on tokens the policy generated" in out and 'sample_id: "a"' in out
    assert summarize(path, FakeTokenizer()).endswith("text:\n    context | b\n    policy  | cd")


def test_inspect_names_a_missing_file(tmp_path):
    done = molt("inspect", tmp_path / "nope.arrow")
    assert done.exit_code == 2 and "nope.arrow' does not exist" in done.stderr


def test_a_recording_cut_off_inside_a_batch_is_named_with_its_whole_batches(tmp_path):
    schema = make_schema([COLUMNS[c] for c in ("sample_id", "token_ids", "loss_mask", "score")], "trajectory")
    path = tmp_path / "rec" / "x.0.arrow"
    w = RecordWriter(path)
    for k in range(3):
        w.write(batch_from_rows([{"sample_id": f"s{k}", "token_ids": list(range(200)), "loss_mask": [True] * 200,
                                  "score": 1.0}], schema))
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 900])  # a kill inside the third batch
    done = molt("inspect", path)
    assert done.exit_code == 2 and f"{path}: cut off or corrupt after 2 whole batches" in done.stderr


def test_a_replay_of_a_cut_off_recording_delivers_the_whole_batches_then_fails_naming_the_file(tmp_path, no_orphans):
    smoke = ["--set", "stages.source.config.num_groups=8"]
    assert molt("run", "pipelines/smoke.yaml", "--run-dir", tmp_path / "run", *smoke).exit_code == 0
    [path] = (tmp_path / "run" / "record" / "advantage.out--sink.in").glob("*.arrow")
    rows = [b.num_rows for b in read_batches(path)]
    whole = len(rows)
    path.write_bytes(path.read_bytes()[:-200])
    assert molt("replay", path, "pipelines/smoke.yaml", "--run-dir", tmp_path / "replay").exit_code == 1
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert f"{path}: cut off or corrupt after {whole - 1} whole batches" in summary["error"]
    delivered = sum(b.num_rows for b in read_batches(tmp_path / "replay" / "record"))
    assert delivered == sum(rows[:-1]), "the whole batches before the cut reached the sink"


def test_bad_files_and_values_are_named(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"name: caf\xe9\n")  # Latin-1, not UTF-8
    for argv in (["graph", bad], ["replay", tmp_path / "r.arrow", bad]):
        done = molt(*argv)
        assert done.exit_code == 2 and f"{bad}: not UTF-8 text: byte 0xe9 at offset 9" in done.stderr
    done = molt("replay", tmp_path / "r.arrow", tmp_path / "missing.yaml")
    assert done.exit_code == 2 and "missing.yaml: pipeline file not found" in done.stderr
    done = molt("graph", "pipelines/smoke.yaml", "--set", "name=[unclosed")
    assert done.exit_code == 2 and "--set name=[unclosed: the value is not YAML" in done.stderr


def test_graph_reports_a_yaml_error_with_exit_code_2(tmp_path):
    bad = tmp_path / "p.yaml"
    bad.write_text("stages: {a: {class: stages.metrics_sink.MetricsSink, confg: {}}}\n")
    done = molt("graph", bad)
    assert done.exit_code == 2 and "stages.a.confg: unknown key; did you mean 'config'?" in done.stderr
    assert done.stderr.startswith("molt: error: ")


def test_molt_help_lists_every_command_with_one_line_and_each_parses_its_options():
    done = molt("--help")
    assert done.exit_code == 0 and "_MOLT_COMPLETE=bash_source molt" in done.stdout
    listed = done.stdout.split("Commands:\n")[1].splitlines()
    names = ["compare", "eval", "export", "graph", "inspect", "models", "plot", "replay", "run", "sweep"]
    assert [line.split()[0] for line in listed] == names
    assert all(not line.endswith("...") for line in listed), listed
    for name in names:
        assert molt(name, "--help").exit_code == 0
    for sub in ("prepare", "upcycle", "vlm"):
        assert molt("models", sub, "-h").exit_code == 0
    assert molt("run", "--help").stdout.count("--set KEY=VALUE") == 1
    assert molt("sweep", "pipelines/smoke.yaml").exit_code == 2  # --seeds is required
    assert molt("eval", "x", "--engine", "tgi").exit_code == 2  # not a choice
    assert molt().exit_code == 2  # a command is required


def test_shell_completion_is_clicks_own():
    done = CliRunner().invoke(main, [], prog_name="molt", env={"_MOLT_COMPLETE": "bash_source"})
    assert done.exit_code == 0 and "_MOLT_COMPLETE=bash_complete" in done.stdout
    env = {"_MOLT_COMPLETE": "bash_complete", "COMP_WORDS": "molt re", "COMP_CWORD": "1"}
    done = CliRunner().invoke(main, [], prog_name="molt", env=env)
    assert done.stdout.split() == ["plain,replay"]


def test_replay_spec_replaces_everything_upstream_of_the_target():
    data = {"name": "p", "stages": {"a": {}, "b": {}, "c": {}, "d": {}},
            "edges": [{"from": "a", "to": "b"}, {"from": "b", "to": "c"}, {"from": "c", "to": "d"},
                      {"from": "c.weights", "to": "a.weights", "feedback": True}]}
    out = replay_spec(data, "rec/", "c", "p.yaml")
    assert sorted(out["stages"]) == ["c", "d", "replay"]
    assert out["edges"] == [{"from": "replay", "to": "c", "record": True}, {"from": "c", "to": "d"}]
    with pytest.raises(ValueError, match="--into 'zz': no such stage"):
        replay_spec(data, "rec/", "zz", "p.yaml")


def test_the_molt_command_imports_custom_classes_from_where_it_starts(tmp_path):
    """As the runner's stage processes do (their PYTHONPATH starts with that folder); the console
    script, unlike ``python -m``, does not put it on sys.path by itself."""
    import os
    import subprocess
    import sys

    (tmp_path / "my_envs.py").write_text("class CountingEnv:\n    pass\n")
    (tmp_path / "p.yaml").write_text(
        "name: custom\nstages:\n"
        "  source: {class: stages.dataset_source.DatasetSource, config: {task: {type: arithmetic, num_problems: 2}}}\n"
        "  rollout: {class: stages.rollout.Rollout, config: {env: my_envs.CountingEnv, engine: {type: transformers}}}\n"
        "  sink: {class: stages.metrics_sink.MetricsSink}\n"
        "edges: [{from: source, to: rollout}, {from: rollout, to: sink}]\n")
    molt = os.path.join(os.path.dirname(sys.executable), "molt")
    out = subprocess.run([str(molt), "graph", "p.yaml"], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert "rollout" in out.stdout


def test_a_torchvision_that_does_not_import_is_named_before_anything_starts(tmp_path):
    fake = tmp_path / "site" / "torchvision"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text('raise RuntimeError("operator torchvision::nms does not exist")\n')
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{os.getcwd()}"}
    for args in (["run", "pipelines/smoke.yaml", "--run-dir", str(tmp_path / "run")],
                 ["sweep", "pipelines/smoke.yaml", "--seeds", "1", "--out", str(tmp_path / "sweep")]):
        out = subprocess.run([sys.executable, "-m", "molt", *args], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "torchvision is installed but does not import beside torch: RuntimeError: operator torchvision::nms" \
               in out.stderr and "hint: pip uninstall -y torchvision torchaudio torchcodec" in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep" / "seed_0").exists()


def test_an_evaluation_that_could_grade_training_problems_is_refused_at_load_naming_both_keys(tmp_path):
    both = "stages.evaluate.config.task and stages.source.config.task both draw from"
    on_train = ["--set", "stages.evaluate.config.task.split=train"]
    for args in (["graph", "pipelines/quickstart.yaml"], ["run", "pipelines/quickstart.yaml", "--resume", tmp_path]):
        done = molt(*args, *on_train)
        assert done.exit_code == 2 and f"{both} the train split of arithmetic" in done.stderr, done.output
    done = molt("graph", "pipelines/gsm8k.yaml", "--set", "stages.evaluate.config.task.path=data/gsm8k/train.jsonl")
    assert done.exit_code == 2 and f"{both} the file {os.path.abspath('data/gsm8k/train.jsonl')}" in done.stderr
    # the rollout's own evaluation (several tasks), refused alike
    from types import SimpleNamespace

    from molt.commands.run import refuse_shared_problems
    from stages.dataset_source import DatasetSource
    from stages.rollout import Rollout

    rollout = Rollout.Config.model_validate({"evaluate": {"tasks": {"a": {"task": {"type": "shapes", "split": "eval"}},
                                                                    "b": {"task": {"type": "shapes"}}}}})
    source = DatasetSource.Config.model_validate({"task": {"type": "shapes"}})
    pipe = SimpleNamespace(source="p.yaml", stages={"source": SimpleNamespace(config=source),
                                                    "rollout": SimpleNamespace(config=rollout)})
    with pytest.raises(ValueError, match=r"p.yaml: stages.rollout.config.evaluate.tasks.b.task and "
                                         r"stages.source.config.task both draw from the train split of shapes"):
        refuse_shared_problems(pipe)
    # the shipped pipelines evaluate on held-out problems: each loads
    for path in ("pipelines/quickstart.yaml", "pipelines/gsm8k.yaml", "pipelines/sft.yaml", "pipelines/agent_tools.yaml"):
        assert molt("graph", path).exit_code == 0, path
