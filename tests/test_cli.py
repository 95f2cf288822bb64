"""molt inspect, replay_spec and --set, without starting a run."""

import json
import os
import subprocess
import sys

import pytest

from molt.commands.cli import main
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


class FakeTokenizer:
    def decode(self, ids):
        return "".join(chr(ord("a") + i) for i in ids)


def test_inspect_prints_rows_columns_docs_and_a_decoded_sample(tmp_path, capsys):
    path = _recording(tmp_path)
    assert main(["inspect", str(path.parent)]) == 0
    out = capsys.readouterr().out
    assert "1 file(s), 1 rows, 1 batches" in out and "molt.schema_version" in out
    assert "true exactly on tokens the policy generated" in out and 'sample_id: "a"' in out
    assert summarize(path, FakeTokenizer()).endswith("text:\n    context | b\n    policy  | cd")


def test_inspect_names_a_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.arrow")]) == 2
    assert "nope.arrow' does not exist" in capsys.readouterr().err


def test_a_recording_cut_off_inside_a_batch_is_named_with_its_whole_batches(tmp_path, capsys):
    schema = make_schema([COLUMNS[c] for c in ("sample_id", "token_ids", "loss_mask", "score")], "trajectory")
    path = tmp_path / "rec" / "x.0.arrow"
    w = RecordWriter(path)
    for k in range(3):
        w.write(batch_from_rows([{"sample_id": f"s{k}", "token_ids": list(range(200)), "loss_mask": [True] * 200,
                                  "score": 1.0}], schema))
    w.close()
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 900])  # a kill inside the third batch
    assert main(["inspect", str(path)]) == 2
    assert f"{path}: cut off or corrupt after 2 whole batches" in capsys.readouterr().err


def test_a_replay_of_a_cut_off_recording_delivers_the_whole_batches_then_fails_naming_the_file(tmp_path, no_orphans):
    smoke = ["--set", "stages.source.config.num_groups=8"]
    assert main(["run", "pipelines/smoke.yaml", "--run-dir", str(tmp_path / "run"), *smoke]) == 0
    [path] = (tmp_path / "run" / "record" / "advantage.out--sink.in").glob("*.arrow")
    rows = [b.num_rows for b in read_batches(path)]
    whole = len(rows)
    path.write_bytes(path.read_bytes()[:-200])
    assert main(["replay", str(path), "pipelines/smoke.yaml", "--run-dir", str(tmp_path / "replay")]) == 1
    summary = json.loads((tmp_path / "replay" / "summary.json").read_text())
    assert f"{path}: cut off or corrupt after {whole - 1} whole batches" in summary["error"]
    delivered = sum(b.num_rows for b in read_batches(tmp_path / "replay" / "record"))
    assert delivered == sum(rows[:-1]), "the whole batches before the cut reached the sink"


def test_bad_files_and_values_are_named(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_bytes(b"name: caf\xe9\n")  # Latin-1, not UTF-8
    for argv in (["graph", str(bad)], ["replay", str(tmp_path / "r.arrow"), str(bad)]):
        assert main(argv) == 2
        assert f"{bad}: not UTF-8 text: byte 0xe9 at offset 9" in capsys.readouterr().err
    assert main(["replay", str(tmp_path / "r.arrow"), str(tmp_path / "missing.yaml")]) == 2
    assert "missing.yaml: pipeline file not found" in capsys.readouterr().err
    assert main(["graph", "pipelines/smoke.yaml", "--set", "name=[unclosed"]) == 2
    assert "--set name=[unclosed: the value is not YAML" in capsys.readouterr().err


def test_graph_reports_a_yaml_error_with_exit_code_2(tmp_path, capsys):
    bad = tmp_path / "p.yaml"
    bad.write_text("stages: {a: {class: stages.metrics_sink.MetricsSink, confg: {}}}\n")
    assert main(["graph", str(bad)]) == 2
    assert "stages.a.confg: unknown key; did you mean 'config'?" in capsys.readouterr().err


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
        out = subprocess.run([sys.executable, "-m", "molt.commands.cli", *args], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "torchvision is installed but does not import beside torch: RuntimeError: operator torchvision::nms" \
               in out.stderr and "hint: pip uninstall -y torchvision torchaudio torchcodec" in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep" / "seed_0").exists()
