"""molt sweep and molt compare: a real two-seed sweep of the model-free pipeline, its resume,
sweep.json's statistics on made-up runs, the comparison's forms and verdicts, and the plots."""

import json
import subprocess
import sys

import pytest
from click.testing import CliRunner

from molt.commands import main
from molt.commands.sweep import Sweep, Threshold, arm_values, summarize_runs

RESULTS = "results={score_mean: sink/score_mean, reward_mean: advantage/reward/mean}"


def molt(*args, cwd=None):
    """``molt ARGS`` as a process of its own (a sweep starts runs, and is stopped by signals)."""
    return subprocess.run([sys.executable, "-m", "molt", *args], capture_output=True, text=True, timeout=300,
                          cwd=cwd)


def invoke(*args):
    """``molt ARGS`` in this process, for commands that only read and print."""
    return CliRunner().invoke(main, args)


@pytest.fixture(scope="module")
def smoke_sweep(tmp_path_factory):
    out = tmp_path_factory.mktemp("sweep") / "smoke"
    done = molt("sweep", "pipelines/smoke.yaml", "--seeds", "2", "--out", str(out), "--set", RESULTS,
                "--threshold", "sink/score_mean=0.5")
    assert done.returncode == 0, done.stderr
    return out


def test_a_two_seed_sweep_runs_each_seed_and_summarises_them(smoke_sweep):
    sweep = json.loads((smoke_sweep / "sweep.json").read_text())
    assert {k: r["status"] for k, r in sweep["runs"].items()} == {"0": "ok", "1": "ok"}
    for k in (0, 1):
        summary = json.loads((smoke_sweep / f"seed_{k}" / "summary.json").read_text())
        assert sweep["results"]["score_mean"]["per_seed"][str(k)] == summary["results"]["score_mean"]
        assert f"\nseed: {k}\n" in (smoke_sweep / f"seed_{k}" / "pipeline.yaml").read_text()
    score = sweep["results"]["score_mean"]
    assert score["n"] == 2 and score["values"][0] != score["values"][1]  # the seeds drew other groups
    assert score["mean"] == pytest.approx(sum(score["values"]) / 2) and score["ci"][0] < score["mean"]
    assert set(sweep["threshold"]["per_seed"]) == {"0", "1"}


def test_a_sweep_started_again_keeps_finished_seeds_runs_new_ones_and_refuses_other_values(smoke_sweep):
    done = molt("sweep", "pipelines/smoke.yaml", "--seeds", "3", "--out", str(smoke_sweep), "--set", RESULTS,
                "--threshold", "sink/score_mean=0.5")
    assert done.returncode == 0, done.stderr
    sweep = json.loads((smoke_sweep / "sweep.json").read_text())
    assert {k: (r["status"], r["starts"]) for k, r in sweep["runs"].items()} == {
        "0": ("ok", 1), "1": ("ok", 1), "2": ("ok", 1)}
    assert sweep["results"]["score_mean"]["n"] == 3
    other = molt("sweep", "pipelines/smoke.yaml", "--seeds", "3", "--out", str(smoke_sweep))
    assert other.returncode == 2 and "holds a sweep of pipelines/smoke.yaml with --set" in other.stderr


def test_compare_takes_a_sweep_folder_and_a_list_of_run_folders(smoke_sweep):
    runs = ",".join(str(smoke_sweep / f"seed_{k}") for k in (0, 1))
    done = invoke("compare", str(smoke_sweep), runs, "--metric", "score_mean", "--margin", "0.5")
    assert done.exit_code == 0, done.output
    assert "verdict:" in done.stdout and "A: n=3" in done.stdout and "B: n=2" in done.stdout
    missing = invoke("compare", str(smoke_sweep), runs, "--metric", "accuracy")
    assert missing.exit_code == 2 and "has no 'accuracy'" in missing.stderr


def test_plot_of_a_sweep_draws_its_threshold_times(smoke_sweep):
    done = invoke("plot", str(smoke_sweep))
    assert done.exit_code == 0, done.output
    assert done.stdout.split() == [str(smoke_sweep / "plots" / "sweep_threshold.png")]


def fake_run(folder, seed, accuracies, start=1000.0):
    """A finished run: evaluate/accuracy (and _stderr 0.02) at versions 0, 8, 16, one per minute."""
    folder.mkdir(parents=True)
    with open(folder / "metrics.jsonl", "w") as f:
        for i, value in enumerate(accuracies):
            f.write(json.dumps({"time": start + 60 * (i + 1), "stage": "evaluate", "replica": 0, "step": 8 * i,
                                "values": {"evaluate/accuracy": value, "evaluate/accuracy_stderr": 0.02}}) + "\n")
    results = {"accuracy_final": accuracies[-1]}
    (folder / "summary.json").write_text(json.dumps({"status": "ok", "results": results, "metrics": {}}))
    return folder


def test_sweep_statistics_give_curves_per_version_and_time_to_threshold(tmp_path):
    runs = {0: fake_run(tmp_path / "a", 0, [0.2, 0.70, 0.80]), 1: fake_run(tmp_path / "b", 1, [0.2, 0.60, 0.71]),
            2: fake_run(tmp_path / "c", 2, [0.2, 0.50, 0.60])}
    started = {k: 1000.0 for k in runs}
    out = summarize_runs(runs, {"accuracy_final": "evaluate/accuracy"}, Threshold("evaluate/accuracy", 0.7),
                         started)
    assert out["results"]["accuracy_final"]["values"] == [0.80, 0.71, 0.60]
    assert out["results"]["accuracy_final"]["mean"] == pytest.approx(0.70333333333)
    curve = out["curves"]["evaluate/accuracy"]
    assert list(curve) == ["0", "8", "16"] and curve["0"]["std"] == 0.0 and curve["8"]["mean"] == pytest.approx(0.6)
    assert out["threshold"]["per_seed"] == {"0": {"seconds": 120.0, "version": 8},
                                            "1": {"seconds": 180.0, "version": 16}, "2": None}
    assert out["threshold"]["success_rate"] == pytest.approx(2 / 3) and out["threshold"]["median_seconds"] == 180.0
    lower = summarize_runs(runs, {}, Threshold("evaluate/accuracy", 0.7, lower_bound=True), started)["threshold"]
    assert lower["per_seed"] == {"0": {"seconds": 180.0, "version": 16}, "1": None, "2": None}
    assert lower["median_seconds"] is None  # more than half never reached it


def test_compare_reads_another_systems_runs_and_says_different_for_means_three_sds_apart(tmp_path):
    ours = tmp_path / "ours.json"
    theirs = tmp_path / "theirs.json"
    ours.write_text(json.dumps({"runs": [{"name": f"s{i}", "results": {"acc": v}}
                                         for i, v in enumerate([0.70, 0.72, 0.74, 0.71, 0.73])]}))
    theirs.write_text(json.dumps({"runs": [{"results": {"acc": v + 0.047}} for v in [0.70, 0.72, 0.74, 0.71, 0.73]]}))
    assert arm_values(str(ours), "acc") == {"s0": 0.70, "s1": 0.72, "s2": 0.74, "s3": 0.71, "s4": 0.73}
    done = invoke("compare", str(ours), str(theirs), "--metric", "acc", "--margin", "0.01",
                  "--json", str(tmp_path / "c.json"))
    assert done.exit_code == 0, done.output
    assert "verdict: different" in done.stdout  # 0.047 is three standard deviations (0.0158)
    assert json.loads((tmp_path / "c.json").read_text())["verdict"] == "different"
    for text in ("[1, 2]", '{"runs": {"s0": {"results": {}}}}', '{"runs": [0.81, 0.80]}'):
        bad = tmp_path / "bad.json"
        bad.write_text(text)
        with pytest.raises(ValueError, match="not a JSON file of the form"):
            arm_values(str(bad), "acc")


def test_a_sweep_arm_holds_the_seeds_it_was_last_asked_for(tmp_path):
    for k in (0, 1):
        fake_run(tmp_path / f"seed_{k}", k, [0.2, 0.5 + k / 10])
    runs = {str(k): {"status": "ok", "started_unix": 0.0, "starts": 1} for k in (0, 1)}
    (tmp_path / "sweep.json").write_text(json.dumps({"seeds": [0], "runs": runs}))  # --seeds 2, then --seeds 1
    assert arm_values(str(tmp_path), "accuracy_final") == {"seed_0": 0.5}
    assert arm_values(f"{tmp_path / 'seed_0'}, {tmp_path / 'seed_1'}", "accuracy_final") == {
        str(tmp_path / "seed_0"): 0.5, str(tmp_path / "seed_1"): 0.6}


@pytest.mark.parametrize("text", ["=0.5", "evaluate/accuracy=nan", "evaluate/accuracy", "evaluate/accuracy=abc"])
def test_a_threshold_without_a_key_or_a_finite_number_is_refused(text):
    with pytest.raises(ValueError, match="expected KEY=NUMBER"):
        Threshold.parse(text)


def test_a_sweep_of_no_seeds_is_refused():
    with pytest.raises(ValueError, match="a sweep needs at least one seed; got 0"):
        Sweep("pipelines/smoke.yaml", [], "unused", 0)


def test_an_unfinished_seed_resumes_from_its_checkpoint_and_one_without_restarts(tmp_path, monkeypatch):
    started = []

    class Done:
        returncode = 0

        def poll(self):
            return 0

    monkeypatch.setattr("molt.commands.sweep.subprocess.Popen", lambda args, **kw: started.append(args) or Done())
    out = tmp_path / "sweep"
    out.mkdir()
    earlier = {"started_unix": 1.0, "starts": 1, "status": "running"}
    (out / "sweep.json").write_text(json.dumps({"pipeline": "pipelines/smoke.yaml", "overrides": [],
                                                "runs": {"0": dict(earlier), "1": dict(earlier)}}))
    sweep = Sweep("pipelines/smoke.yaml", [], out, 2)
    (out / "seed_0" / "checkpoints" / "barrier_4").mkdir(parents=True)
    (out / "seed_0" / "pipeline.yaml").write_text("name: smoke\n")
    for name in sweep.names:
        (out / "seed_0" / "checkpoints" / "barrier_4" / f"{name}.json").write_text("{}")
    (out / "seed_1").mkdir()
    (out / "seed_1" / "leftover").write_text("")
    assert sweep.run() == 1  # the stand-ins wrote no summary: both count as failed
    assert started[0][-2:] == ["--resume", str(out / "seed_0")]
    assert started[1][-2:] == ["--run-dir", str(out / "seed_1")] and not (out / "seed_1" / "leftover").exists()
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert runs["0"]["started_unix"] == 1.0 and runs["1"]["started_unix"] > 1.0  # time counts from the kept start
    assert runs["0"]["starts"] == runs["1"]["starts"] == 2



def started_before_the_first_poll(tmp_path, monkeypatch, overrides):
    """How many seeds' runs a 3-seed sweep had started when it first looked whether one had ended."""
    started, counts = [], []

    class Proc:
        returncode = 0

        def poll(self):
            counts.append(len(started))
            return 0

    monkeypatch.setattr("molt.commands.sweep.subprocess.Popen", lambda args, **kw: started.append(args) or Proc())
    Sweep("pipelines/smoke.yaml", overrides, tmp_path / str(len(overrides)), 3).run()
    assert len(started) == 3
    return counts[0]


def test_on_ray_every_seed_starts_at_once_and_locally_one_at_a_time(tmp_path, monkeypatch):
    assert started_before_the_first_poll(tmp_path, monkeypatch, ["placement.backend=ray"]) == 3
    assert started_before_the_first_poll(tmp_path, monkeypatch, []) == 1


def test_the_live_table_shows_each_seeds_state_and_latest_results(tmp_path):
    from rich.console import Console

    sweep = Sweep("pipelines/quickstart.yaml", [], tmp_path / "sweep", 2)
    fake_run(tmp_path / "sweep" / "seed_0", 0, [0.2, 0.7])
    sweep.runs["0"] = {"status": "running", "started_unix": 0.0, "starts": 1}
    shown = []
    sweep._show(type("Live", (), {"update": lambda self, table: shown.append(table)})(), {0: None})
    console = Console(record=True, width=200)
    console.print(shown[0])
    text = console.export_text()
    assert "running" in text and "waiting" in text and "0.7" in text  # accuracy_final of seed 0 so far


def test_ctrl_c_stops_the_running_seed_cleanly_and_a_sweep_again_would_resume_it(tmp_path):
    import signal
    import time

    out = tmp_path / "sweep"
    proc = subprocess.Popen([sys.executable, "-m", "molt", "sweep", "pipelines/smoke.yaml", "--seeds", "2",
                             "--out", str(out), "--set", "stages.source.config.num_groups=10000000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 120
    while not (out / "seed_0" / "metrics.jsonl").is_file() and time.monotonic() < deadline:
        time.sleep(0.2)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=120) == 130, proc.stderr.read()
    runs = json.loads((out / "sweep.json").read_text())["runs"]
    assert list(runs) == ["0"] and runs["0"]["status"] == "interrupted"
    assert json.loads((out / "seed_0" / "summary.json").read_text())["status"] == "interrupted"
