"""`requires:` (molt.commands.run.make_required): a pipeline names the pipeline that makes a model it starts from;
`molt run` and `molt sweep` make that model first, once, when the cache lacks it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from molt.runtime.pipeline import Pipeline

MAKER = """name: maker
stages:
  source: {class: stages.synthetic_source.SyntheticSource, config: {num_groups: 6, group_size: 2}}
  sink: {class: tests.doubles.stages.ModelMaker, config: {name: made-model}}
edges:
  - {from: source, to: sink}
"""
USER = """name: user
requires: {made-model: maker.yaml}
stages:
  source: {class: stages.synthetic_source.SyntheticSource, config: {num_groups: 2}}
  sink: {class: stages.metrics_sink.MetricsSink}
edges:
  - {from: source, to: sink}
"""


def molt(tmp_path, *args):
    env = {**os.environ, "MOLT_CACHE": str(tmp_path / "cache")}
    return subprocess.run([sys.executable, "-m", "molt", *args], capture_output=True, text=True, timeout=300,
                          env=env, cwd=os.getcwd())


@pytest.fixture
def pipelines(tmp_path):
    folder = tmp_path / "pipelines"
    folder.mkdir()
    (folder / "maker.yaml").write_text(MAKER)
    (folder / "user.yaml").write_text(USER)
    return folder


def test_a_missing_required_model_is_made_first_once_and_then_reused(tmp_path, pipelines, no_orphans):
    out = molt(tmp_path, "run", str(pipelines / "user.yaml"), "--run-dir", str(tmp_path / "one"))
    assert out.returncode == 0, out.stderr[-3000:]
    assert "requires the model made-model, which" in out.stderr and "running it first in" in out.stderr
    assert json.loads((tmp_path / "cache" / "models" / "made-model" / "config.json").read_text()) == {"rows": 12}
    made = json.loads((tmp_path / "one" / "requires" / "made-model" / "summary.json").read_text())
    assert made["status"] == "ok", "the maker ran as a run of its own, inside the user's run folder"
    assert json.loads((tmp_path / "one" / "summary.json").read_text())["status"] == "ok"
    out = molt(tmp_path, "sweep", str(pipelines / "user.yaml"), "--seeds", "1", "--out", str(tmp_path / "sweep"))
    assert out.returncode == 0 and "running it first" not in out.stderr, out.stderr[-3000:]
    assert not (tmp_path / "sweep" / "requires").exists(), "made once: the sweep reuses it"


def test_a_required_pipeline_that_fails_or_writes_no_model_stops_the_run_naming_it(tmp_path, pipelines):
    (pipelines / "maker.yaml").write_text(MAKER.replace("{name: made-model}", "{name: other-model}"))
    out = molt(tmp_path, "run", str(pipelines / "user.yaml"), "--run-dir", str(tmp_path / "one"))
    assert out.returncode == 2 and "requires.made-model: " in out.stderr
    assert "finished without writing the model 'made-model'" in out.stderr
    assert "hint: its train stage's export_model must be 'made-model'" in out.stderr
    failing = MAKER.replace("  sink:", "  boom: {class: tests.doubles.stages.Boom}\n  sink:")
    (pipelines / "maker.yaml").write_text(failing.replace("{from: source, to: sink}",
                                                          "{from: source, to: boom}\n  - {from: boom, to: sink}"))
    out = molt(tmp_path, "run", str(pipelines / "user.yaml"), "--run-dir", str(tmp_path / "two"))
    assert out.returncode == 1 and "the run making made-model (requires.made-model:" in out.stderr, out.stderr[-2000:]
    assert not (tmp_path / "two" / "summary.json").exists(), "the pipeline itself never started"


def test_requires_names_a_model_and_an_existing_pipeline_file_beside_the_yaml(pipelines):
    assert Pipeline.from_yaml(pipelines / "user.yaml").spec.requires == {"made-model": str(pipelines / "maker.yaml")}
    with pytest.raises(ValueError, match=r"user.yaml \(with --set .*\): requires.made-model: a model name \(no '/'\) and an existing "
                                         r"pipeline file; got 'made-model': '.*/nothing.yaml'"):
        Pipeline.from_yaml(pipelines / "user.yaml", ["requires={made-model: nothing.yaml}"])
    vlm = Pipeline.from_yaml("pipelines/vlm_moe.yaml")
    sft = str(Path("pipelines/sft.yaml").resolve())
    assert vlm.spec.requires == {"shapes-vlm-moe-sft": sft}
    assert f"requires: shapes-vlm-moe-sft (made by {sft})" in vlm.describe()  # molt graph
    saved = pipelines / "run" / "pipeline.yaml"  # what every process of a run loads: the same file
    saved.parent.mkdir()
    saved.write_text(yaml.safe_dump(vlm.to_dict()))
    assert Pipeline.from_yaml(saved).spec.requires == {"shapes-vlm-moe-sft": sft}
