"""The README's first example, `pipelines/quickstart.yaml`, run short: every stage real (vLLM rollout and
evaluation engines, FSDP2 trainer, verified refit), two optimizer steps, then `molt plot` and
`molt replay --from-step` on its run."""

import json
import subprocess

import torch

from molt.runtime.pipeline import Pipeline
from molt.commands.plot import plot_run
from molt.runtime.recording import read_batches
from molt.runtime.runner import Runner
from molt.train.model import load_policy, shard_policy
from tests.test_checkpoint import MOLT, step_records

SHORT = [
    "stages.source.config.task.num_problems=8", "stages.source.config.prompts_per_batch=4",
    "stages.source.config.checkpoint_every_batches=1",
    "stages.rollout.config.group_size=4", "policy.groups_per_step=4",
    "stages.evaluate.config.task.num_problems=16", "stages.evaluate.config.every_versions=1",
]


def test_a_short_quickstart_trains_evaluates_checkpoints_and_plots(default_model_dir, tmp_path, no_orphans):
    run = tmp_path / "run"
    # the rollout admits step 1's groups only at version 1, so it refits (at staleness 1 it may finish first)
    code = Runner(Pipeline.from_yaml("pipelines/quickstart.yaml", [*SHORT, "stages.rollout.config.max_staleness=0"]),
                  run, live=False).run()
    summary = json.loads((run / "summary.json").read_text())
    assert code == 0, summary["error"]
    results = summary["results"]
    assert results["steps"] == 2 and results["evaluated_version"] == 2
    assert 0 <= results["accuracy_baseline"] <= 1 and 0 <= results["accuracy_final"] <= 1
    assert results["tokens_generated"] > 0 and results["tokens_trained"] > results["tokens_generated"]
    assert 0 <= results["mean_staleness"] <= 1, "max_staleness: 1 holds"
    assert results["eval_problems"] == 16, "the distinct problems evaluated"
    assert summary["metrics"]["rollout/refit_seconds"] >= 0, "the rollout loaded (and verified) new weights"
    on_policy_step_has_ratio_one(default_model_dir, run)
    evals = [r["policy_version"] for b in read_batches(run / "record" / "evaluate.out--eval_sink.in")
             for r in b.to_pylist()]
    assert evals[0] == 0 and evals[-1] == 2 and evals == sorted(set(evals)), evals  # the newest when several wait
    steps = [r for b in read_batches(run / "record" / "train.out--sink.in") for r in b.to_pylist()]
    assert [r["policy_version"] for r in steps] == [1, 2] and all(r["num_rows"] == 16 for r in steps)
    assert sum(b.num_rows for b in read_batches(run / "record" / "rollout.out--reward.in")) == 32
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["barrier_1", "barrier_2"], \
        "keep_checkpoints: 2"
    names = {p.name for p in plot_run(run)}
    assert {"reward.png", "eval.png", "logprob_diff.png", "staleness.png", "time.png"} <= names, names
    # the README's `molt replay RUN_DIR --from-step K`: the training side re-run from the recorded trajectories
    out = subprocess.run([*MOLT, "replay", str(run), "--from-step", "1", "--run-dir", str(tmp_path / "replay")],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    replayed = step_records(tmp_path / "replay")
    assert [(r["step"], r["loss"], r["grad_norm"]) for r in replayed] == [
        (r["step"], r["loss"], r["grad_norm"]) for r in step_records(run)[1:]]


def on_policy_step_has_ratio_one(model_dir, run):
    """The defaults keep trainer and engine in one precision (molt.policy): the trainer's logprobs of
    the rows the engine sampled at version 0, with the trainer at version 0, are the engine's."""
    config = Pipeline.from_yaml(run / "pipeline.yaml").stages["train"].config
    model = shard_policy(load_policy(model_dir, config.temperature), config.compute_dtype)
    rows = [r for b in read_batches(run / "record" / "rollout.out--reward.in") for r in b.to_pylist()
            if max(r["policy_version"]) == 0]
    with torch.no_grad():
        diffs = torch.cat([(model(torch.tensor([r["token_ids"]]), torch.arange(len(r["token_ids"]))[None])
                            - torch.tensor(r["rollout_logprobs"]))[torch.tensor(r["loss_mask"])] for r in rows[:16]])
    assert config.compute_dtype == "float32" and len(diffs) > 16
    assert diffs.abs().mean() < 2e-5 and diffs.abs().max() < 1e-4, (diffs.abs().mean(), diffs.abs().max())


def test_the_gsm8k_pipelines_load_the_shipped_data_and_its_answers_grade_right():
    cpu, gpu = Pipeline.from_yaml("pipelines/gsm8k.yaml"), Pipeline.from_yaml("pipelines/gsm8k_gpu.yaml")
    train = cpu.stages["source"].config.task.load()
    test = gpu.stages["evaluate"].config.task.load()
    assert (train.num_records, test.num_records) == (7473, 1319)  # OpenAI's GSM8K train and test splits
    grader = cpu.stages["reward"].config.grader
    record = test.record(0)
    assert grader.grade("She sells 9 eggs for $2 each.\n#### 18", str(record["answer"])).score == 1.0
    assert grader.grade("#### 17", str(record["answer"])).score == 0.0
    assert gpu.stages["rollout"].gpus == [0, 1, 2, 3] and gpu.stages["train"].gpus == [4, 5, 6, 7]
