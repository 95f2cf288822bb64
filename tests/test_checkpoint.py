"""Checkpoints at aligned barriers and exact resume (molt.runtime.checkpoint, `molt run --resume`)."""

import json
import shutil
import subprocess
import sys

import pyarrow as pa
import pytest
import torch
import yaml
from safetensors.torch import load_file

from molt.runtime.checkpoint import complete_checkpoints, latest_checkpoint, prune_checkpoints, replica_names
from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import RecordWriter, read_batches
from molt.runtime.runner import Runner
from tests.conftest import SINK, SOURCE, run_spec
from tests.test_train import rl_pipeline

MOLT = [sys.executable, "-m", "molt"]


def batch(i):
    return pa.record_batch({"x": [i]})


def test_a_resumed_recording_keeps_exactly_the_checkpointed_batches(tmp_path):
    path = tmp_path / "e" / "s.0.arrow"
    writer = RecordWriter(path)
    for i in range(5):
        writer.write(batch(i))
    writer.close()
    resumed = RecordWriter(path, keep_batches=3)
    resumed.write(batch(9))
    resumed.close()
    assert [b.column("x")[0].as_py() for b in read_batches(path)] == [0, 1, 2, 9]
    with pytest.raises(ValueError, match="holds 4 complete batches but the checkpoint counted 6"):
        RecordWriter(path, keep_batches=6)


def test_only_complete_checkpoints_are_resumed_or_kept(tmp_path):
    names = replica_names({"a": 2, "b": 1})
    assert names == {"a.0", "a.1", "b.0"}
    for step, parts in [(1, names), (2, names), (3, names), (4, {"a.0", "b.0"})]:
        for n in parts:
            (tmp_path / "checkpoints" / f"barrier_{step}").mkdir(parents=True, exist_ok=True)
            (tmp_path / "checkpoints" / f"barrier_{step}" / f"{n}.json").write_text("{}")
    assert latest_checkpoint(tmp_path, names).name == "barrier_3", "barrier_4 lacks a.1"
    prune_checkpoints(tmp_path, names, keep=2)
    assert [p.name for p in complete_checkpoints(tmp_path, names)] == ["barrier_2", "barrier_3"]
    assert (tmp_path / "checkpoints" / "barrier_4").exists(), "a newer, unfinished one is being written"
    with pytest.raises(ValueError, match=r"no complete checkpoint; barrier_4 is incomplete \(no state of \['a.1'"):
        latest_checkpoint(tmp_path / "checkpoints" / "..", names | {"c.0"})


def drop_checkpoints_after(run_dir, step):
    """Make a finished run look stopped right after barrier ``step`` (later ones never written)."""
    for p in (run_dir / "checkpoints").iterdir():
        if int(p.name.removeprefix("barrier_")) > step:
            shutil.rmtree(p)


def test_a_resumed_run_delivers_every_row_exactly_once(tmp_path, no_orphans):
    spec = {"name": "ckpt", "keep_checkpoints": None, "stages": {
        "source": {"class": SOURCE, "config": {"num_groups": 6, "groups_per_batch": 1,
                                               "checkpoint_every_batches": 2}},
        "shape": {"class": "stages.shape_reward.ShapeReward", "replicas": 2},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "shape", "kind": "keyed"},
                  {"from": "shape", "to": "sink", "record": True}]}
    code, _ = run_spec(spec, tmp_path / "run")
    assert code == 0
    full = sorted(r["sample_id"] for b in read_batches(tmp_path / "run" / "record") for r in b.to_pylist())
    drop_checkpoints_after(tmp_path / "run", 2)
    for torn in ("metrics/sink.0.jsonl", "metrics.jsonl"):  # lines cut in half by a kill
        with open(tmp_path / "run" / torn, "a") as f:
            f.write('{"time": 1.0, "stage": "sink", "rep')
    assert Runner(Pipeline.from_spec(spec), tmp_path / "run", live=False, resume=True).run() == 0
    resumed = sorted(r["sample_id"] for b in read_batches(tmp_path / "run" / "record") for r in b.to_pylist())
    assert resumed == full and len(full) == 24
    merged = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for replica in (tmp_path / "run" / "metrics").glob("*.jsonl"):  # every line once: none again, none torn
        lines = [json.loads(line) for line in replica.read_text().splitlines()]
        assert [m for m in merged if f"{m['stage']}.{m['replica']}.jsonl" == replica.name] == lines, replica.name
    assert json.loads((tmp_path / "run" / "resume.json").read_text())["checkpoint"].endswith("barrier_2")


def test_resume_refuses_a_run_without_a_complete_checkpoint(tmp_path):
    (tmp_path / "run" / "checkpoints" / "barrier_1").mkdir(parents=True)
    (tmp_path / "run" / "pipeline.yaml").write_text(yaml.safe_dump(Pipeline.from_yaml("pipelines/smoke.yaml").to_dict()))
    out = subprocess.run([*MOLT, "run", "pipelines/smoke.yaml", "--resume", str(tmp_path / "run")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert "no complete checkpoint; barrier_1 is incomplete" in out.stderr


def resumable_rl(model):
    """Synchronous RL (max_staleness 0) with a checkpoint after every prompt: 8 prompts, 2 groups per step."""
    spec = rl_pipeline(model, world_size=1)
    spec["keep_checkpoints"] = None
    spec["stages"]["source"]["config"] = {"task": {"type": "arithmetic", "num_problems": 8},
                                          "prompts_per_batch": 1, "checkpoint_every_batches": 1}
    spec["stages"]["rollout"]["config"]["max_staleness"] = 0
    spec["stages"]["train"]["config"]["max_staleness"] = 0
    for edge in ({"from": "pack", "to": "train"}, {"from": "rollout", "to": "reward"}):
        spec["edges"].remove(edge)
        spec["edges"].append({**edge, "record": True})
    return spec


def step_records(run_dir):
    return [r for b in read_batches(run_dir / "record" / "train.out--sink.in") for r in b.to_pylist()]


def test_a_run_resumed_after_step_one_reaches_the_uninterrupted_weights_at_step_four(
        tiny_chat_model, full_rl_run, tmp_path, no_orphans):
    spec = resumable_rl(tiny_chat_model)
    shutil.copytree(full_rl_run, tmp_path / "resumed")
    # Stopped after prompt 5: steps 0-1 trained (version 2), one group of step 2 held by pack.
    drop_checkpoints_after(tmp_path / "resumed", 5)
    pack_state = json.loads((tmp_path / "resumed" / "checkpoints" / "barrier_5" / "pack.0.json").read_text())
    assert pack_state["state"] == {"step": 2, "num_groups_held": 1}
    (tmp_path / "resumed" / "checkpoints" / "barrier_5" / "train.0.json").rename(
        tmp_path / "resumed" / "checkpoints" / "barrier_5" / "train.0.json.lost")  # half-written: not resumed
    shutil.rmtree(tmp_path / "resumed" / "checkpoints" / "barrier_4")
    # Resumed on two train ranks: the full-state checkpoint is broadcast from rank 0 and re-sharded.
    spec["stages"]["train"]["world_size"] = spec["stages"]["pack"]["config"]["world_size"] = 2
    code = Runner(Pipeline.from_spec(spec), tmp_path / "resumed", live=False, resume=True).run()
    assert code == 0, (tmp_path / "resumed" / "summary.json").read_text()
    assert json.loads((tmp_path / "resumed" / "resume.json").read_text())["checkpoint"].endswith("barrier_3")

    final = [load_file(str(run / "checkpoints" / "barrier_8" / "train" / "model.safetensors"))
             for run in (full_rl_run, tmp_path / "resumed")]
    assert final[0].keys() == final[1].keys()
    for name in final[0]:
        torch.testing.assert_close(final[1][name], final[0][name], rtol=0, atol=1e-6, msg=name)
    start = load_file(str(full_rl_run / "checkpoints" / "barrier_3" / "train" / "model.safetensors"))
    assert any(not torch.equal(start[n], final[0][n]) for n in start), "steps after the checkpoint trained"
    trained = [[sorted(set(b.column("prompt_id").to_pylist())), b.column("step")[0].as_py()]
               for b in read_batches(tmp_path / "resumed" / "record" / "pack.out--train.in")]
    expected = [[sorted(set(b.column("prompt_id").to_pylist())), b.column("step")[0].as_py()]
                for b in read_batches(full_rl_run / "record" / "pack.out--train.in")]
    assert trained == expected and [s for _, s in trained] == [0, 1, 2, 3], "every prompt trained once, in order"


def test_replay_from_step_two_repeats_the_recorded_losses_of_steps_two_and_three(full_rl_run, tmp_path, no_orphans):
    out = subprocess.run([*MOLT, "replay", str(full_rl_run), "--from-step", "2", "--run-dir", str(tmp_path / "r")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "replaying rollout.out->reward.in after barrier_4 (step 2)" in out.stderr
    replayed, recorded = step_records(tmp_path / "r"), step_records(full_rl_run)
    assert [r["step"] for r in replayed] == [2, 3]
    for new, old in zip(replayed, recorded[2:]):
        assert new["loss"] == old["loss"] and new["grad_norm"] == old["grad_norm"], (new, old)
    assert "evaluate" not in (tmp_path / "r" / "pipeline.yaml").read_text()
    log = (tmp_path / "r" / "logs" / "train.0.log").read_text()
    assert "published version" not in log, "no stage subscribes to the weights: the trainer publishes none"
    assert "published version" in (full_rl_run / "logs" / "train.0.log").read_text()
    out = subprocess.run([*MOLT, "replay", str(full_rl_run), "--from-step", "7"], capture_output=True, text=True)
    assert out.returncode == 2 and "no complete checkpoint at step 7; got checkpoints at steps [0, 1, 2, 3, 4]" in out.stderr
