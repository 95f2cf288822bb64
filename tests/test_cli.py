"""molt inspect, replay_spec and --set, without starting a run."""

import os
import subprocess
import sys

import pytest

from molt.cli import main, replay_spec
from molt.recording import RecordWriter, summarize
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
    assert "text: b[[cd]]" in summarize(path, FakeTokenizer())


def test_inspect_names_a_missing_file(tmp_path, capsys):
    assert main(["inspect", str(tmp_path / "nope.arrow")]) == 2
    assert "nope.arrow' does not exist" in capsys.readouterr().err


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
        out = subprocess.run([sys.executable, "-m", "molt.cli", *args], capture_output=True, text=True, env=env,
                             timeout=120)
        assert out.returncode == 2, out.stderr[-2000:]
        assert "torchvision is installed but does not import beside torch: RuntimeError: operator torchvision::nms" \
               in out.stderr and "hint: pip uninstall -y torchvision torchaudio torchcodec" in out.stderr
    assert not (tmp_path / "run").exists() and not (tmp_path / "sweep" / "seed_0").exists()
