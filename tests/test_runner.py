"""The runner through real processes and sockets: drain, failures, Ctrl-C, groups, replay."""

import contextlib
import json
import shutil
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from molt.runtime.recording import read_batches
from tests.conftest import SINK, SOURCE, run_spec

MOLT = [sys.executable, "-m", "molt"]


def chain(*stages, record_last=False, **source_cfg):
    """source -> stages... -> sink, as a pipeline dict."""
    spec = {"name": "t", "stop_timeout_s": 5, "stages": {"source": {"class": SOURCE, "config": source_cfg}}, "edges": []}
    prev = "source"
    for name, cls, extra in stages:
        spec["stages"][name] = {"class": cls, **extra}
        spec["edges"].append({"from": prev, "to": name})
        prev = name
    spec["stages"]["sink"] = {"class": SINK}
    spec["edges"].append({"from": prev, "to": "sink", "record": record_last})
    return spec


def recorded_rows(run_dir: Path, edge: str) -> list[dict]:
    return [r for b in read_batches(run_dir / "record" / edge) for r in b.to_pylist()]


def test_smoke_pipeline_runs_through_the_cli_and_delivers_every_row_once(tmp_path, no_orphans):
    run_dir = tmp_path / ("a-folder-name-long-enough-that-its-path-could-not-hold-a-socket-" * 2) / "run"
    out = subprocess.run([*MOLT, "run", "pipelines/smoke.yaml", "--run-dir", str(run_dir)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "ok"
    assert summary["metrics"]["source/rows_out"] == summary["metrics"]["sink/rows_in"] == 256
    rows = recorded_rows(run_dir, "advantage.out--sink.in")
    assert len(rows) == 256 and len({r["sample_id"] for r in rows}) == 256
    assert all(r["reward"] is not None and len(r["advantages"]) == len(r["token_ids"]) for r in rows)
    for name in ("pipeline.yaml", "wiring.json", "metrics.jsonl", "logs/shape.1.log", "status/sink.0.json"):
        assert (run_dir / name).exists(), name
    # the ipc sockets lived in the run's private scratch folder (mkdtemp: mode 0700, a random name), now gone
    folders = {Path(ep[len("ipc://"):]).parent for w in json.loads((run_dir / "wiring.json").read_text()).values()
               for ep in w["endpoints"]}
    [sock] = folders
    assert sock.name == "sock" and sock.parent.name.startswith("molt-run-") and not sock.parent.exists()
    assert not (run_dir / "sock").exists()
    graph = subprocess.run([*MOLT, "graph", "pipelines/smoke.yaml"], capture_output=True, text=True, timeout=60)
    assert graph.returncode == 0 and "advantage.out->sink.in" in graph.stdout


def test_record_then_replay_is_bit_identical(tmp_path, no_orphans):
    first = tmp_path / "first"
    code, _ = run_spec(chain(record_last=True, num_groups=6, groups_per_batch=2), first)
    assert code == 0
    recorded = first / "record" / "source.out--sink.in"
    second = tmp_path / "second"
    out = subprocess.run([*MOLT, "replay", str(recorded), "pipelines/smoke.yaml",  # --into read from the path
                          "--run-dir", str(second)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    a = (recorded / "source.0.arrow").read_bytes()
    b = (second / "record" / "replay.out--sink.in" / "replay.0.arrow").read_bytes()
    assert len(a) > 1000 and a == b


def test_a_stage_raising_in_process_stops_the_run_naming_it(tmp_path, no_orphans):
    start = time.monotonic()
    code, summary = run_spec(chain(("boom", "tests.doubles.stages.Boom", {"config": {"fail_at": 2}}),
                                   num_groups=40, groups_per_batch=1), tmp_path / "run")
    assert code == 1 and time.monotonic() - start < 60
    assert summary["failed_stage"] == "boom.0"
    assert "RuntimeError: boom at batch 2" in summary["error"]
    down = json.loads((tmp_path / "run" / "status" / "sink.0.json").read_text())
    assert down["upstream"] and "upstream stage 'boom' failed" in down["error"]


def test_a_stage_failing_in_setup_stops_the_run(tmp_path, no_orphans):
    code, summary = run_spec(chain(("boom", "tests.doubles.stages.Boom", {"config": {"in_setup": True}})),
                             tmp_path / "run")
    assert code == 1 and summary["failed_stage"] == "boom.0"
    assert "boom in setup" in summary["error"]


def test_a_stage_killed_with_sigkill_stops_the_run(tmp_path, no_orphans):
    code, summary = run_spec(chain(("boom", "tests.doubles.stages.Boom", {"config": {"kill_self": True}}),
                                   num_groups=40, groups_per_batch=1), tmp_path / "run")
    assert code == 1 and summary["failed_stage"] == "boom.0"
    assert "killed by signal SIGKILL" in summary["error"]
    assert "SIGKILL to myself at batch 1" in summary["error"], "the log's last lines: a death without a status"


def test_ctrl_c_stops_every_process_including_grandchildren(tmp_path, no_orphans):
    run_dir = tmp_path / "run"
    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"replicas": 2, "config": {"sleep_s": 30, "spawn_child": True}}),
                 num_groups=8)
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(spec))  # JSON is YAML
    # Started as a shell without job control starts `molt run &`: with SIGINT ignored (inherited).
    proc = subprocess.Popen([*MOLT, "run", str(path), "--run-dir", str(run_dir)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    pid_files = [run_dir / f"pids.slow.{r}" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [pid for p in pid_files for pid in json.loads(p.read_text())]
    assert len(pids) == 4
    source_metrics = run_dir / "metrics" / "source.0.jsonl"
    while not (source_metrics.exists() and source_metrics.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)  # the source has sent its first batch
    proc.send_signal(signal.SIGINT)
    assert proc.wait(timeout=30) == 130
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {alive}"
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "interrupted" and summary["wall_s"] > 0
    assert summary["metrics"]["source/rows_out"] > 0, "what ran before the interrupt is summarised"


def test_a_second_ctrl_c_kills_at_once_and_the_run_still_ends_cleanly(tmp_path, no_orphans):
    run_dir = tmp_path / "run"
    spec = chain(("slow", "tests.doubles.stages.Sleepy",
                  {"config": {"sleep_s": 30, "spawn_child": True, "ignore_sigterm": True}}), num_groups=8)
    spec["stop_timeout_s"] = 120  # a stage that ignores SIGTERM would hold the first stop this long
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(spec))
    proc = subprocess.Popen([*MOLT, "run", str(path), "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    while not (run_dir / "pids.slow.0").exists() and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = json.loads((run_dir / "pids.slow.0").read_text())
    proc.send_signal(signal.SIGINT)
    time.sleep(1.0)  # the stop sequence is waiting for the stage that ignores SIGTERM
    start = time.monotonic()
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and time.monotonic() - start < 20, err[-3000:]
    assert "Traceback" not in err and "a second stop signal: killing every process without waiting" in err
    time.sleep(0.5)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    sockets = {ep for w in json.loads((run_dir / "wiring.json").read_text()).values() for ep in w["endpoints"]}
    assert not any(Path(ep[len("ipc://"):]).parent.parent.exists() for ep in sockets), "the scratch folder is gone"


def test_a_killed_molt_run_leaves_no_process_and_no_scratch_folder_behind(tmp_path, no_orphans):
    """Even a process that a stage started in a session of its own (as a daemon, or a helper that calls setsid)."""
    run_dir = tmp_path / "run"
    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"replicas": 2, "config": {
        "sleep_s": 30, "spawn_child": True, "child_session": True}}), num_groups=8)
    path = tmp_path / "p.yaml"
    path.write_text(json.dumps(spec))
    proc = subprocess.Popen([*MOLT, "run", str(path), "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    pid_files = [run_dir / f"pids.slow.{r}" for r in range(2)]
    deadline = time.monotonic() + 60
    while not all(p.exists() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [pid for p in pid_files for pid in json.loads(p.read_text())]  # the stages and the children they started
    sockets = {ep for w in json.loads((run_dir / "wiring.json").read_text()).values() for ep in w["endpoints"]}
    scratch = Path(next(iter(sockets))[len("ipc://"):]).parent.parent
    assert scratch.exists() and len(pids) == 4
    proc.kill()  # SIGKILL: molt run cannot clean up; its janitor does
    proc.wait()
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (scratch.exists() or any(
            psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids)):
        time.sleep(0.2)
    assert not [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not scratch.exists()


def test_the_janitor_kills_a_runs_process_in_any_session_and_unlinks_only_the_shared_memory_it_made(tmp_path):
    """A run's process in a session of its own holding shared memory and a semaphore (as vLLM's engine core):
    at the run's end the janitor kills it and unlinks both; an older object it only opened and a process
    outside the run are left alone."""
    from multiprocessing import shared_memory

    from molt.runtime.placement import Janitor
    from molt.runtime.stage import SCRATCH_ENV

    older = shared_memory.SharedMemory(create=True, size=4096)  # made before the run
    outside = subprocess.Popen(["sleep", "60"], start_new_session=True)
    scratch = tmp_path / "scratch"
    scratch.mkdir()
    janitor = Janitor(scratch)
    code = ("import multiprocessing, sys, time; from multiprocessing import shared_memory\n"
            "made = shared_memory.SharedMemory(create=True, size=1 << 20)\n"
            "lock = multiprocessing.get_context('spawn').Lock()  # /dev/shm/sem.mp-*\n"
            "opened = open('/dev/shm/' + sys.argv[1], 'rb')\n"
            "print(made.name, 'sem.' + lock._semlock.name.lstrip('/'), flush=True)\n"
            "time.sleep(60)")
    helper = subprocess.Popen([sys.executable, "-c", code, older.name], stdout=subprocess.PIPE, text=True,
                              env={**os.environ, SCRATCH_ENV: str(scratch)}, start_new_session=True)
    try:
        made = helper.stdout.readline().split()
        assert len(made) == 2 and all(os.path.exists(f"/dev/shm/{name}") for name in made)
        janitor.done()
        assert helper.wait(timeout=10) == -signal.SIGKILL and outside.poll() is None
        assert not [name for name in made if os.path.exists(f"/dev/shm/{name}")]
        assert os.path.exists(f"/dev/shm/{older.name}") and not scratch.exists()
    finally:
        helper.kill()
        outside.kill()
        older.unlink()


# about 50 s each on 2 CPUs: Ctrl-C's stop is the same cleanup at the same end, among the slow tests
@pytest.mark.parametrize("how", [signal.SIGKILL, pytest.param(signal.SIGINT, marks=pytest.mark.slow)],
                         ids=["SIGKILL", "SIGINT"])
def test_a_killed_or_interrupted_run_with_a_vllm_engine_leaves_no_process_and_no_shared_memory(
        how, default_model_dir, tmp_path, no_orphans):
    """vLLM's engine core and workers hold ~400 MiB of shared memory (/dev/shm/psm_*, sem.mp-*) that its own
    shutdown alone unlinks."""
    pytest.importorskip("vllm")

    def shm() -> dict[str, int]:  # name -> inode of each object of Python's multiprocessing
        found = {}
        for entry in os.scandir("/dev/shm"):
            with contextlib.suppress(OSError):  # gone meanwhile
                if entry.name.startswith(("psm_", "sem.mp-")):
                    found[entry.name] = entry.stat().st_ino
        return found

    before, run_dir = shm(), tmp_path / "run"
    proc = subprocess.Popen([*MOLT, "run", "pipelines/rollout_only.yaml", "--run-dir", str(run_dir),
                             "--set", "stages.source.config.task.num_problems=100000"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    log, deadline = run_dir / "logs" / "rollout.0.log", time.monotonic() + 240
    while not (log.exists() and "vLLM engine for" in log.read_text()) and time.monotonic() < deadline:
        assert proc.poll() is None, "the run ended early"
        time.sleep(0.5)
    started = psutil.Process(proc.pid).children(recursive=True)  # the janitor, stages, engine core and workers
    assert len(started) >= 6 and shm().keys() - before.keys(), "the engine runs, holding shared memory"
    proc.send_signal(how)
    proc.wait(timeout=120)
    psutil.wait_procs(started, timeout=60)
    assert not [p for p in started if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
    mapped = set()  # by any process: another run's (other tests may run meanwhile)
    for maps in Path("/proc").glob("[0-9]*/maps"):
        with contextlib.suppress(OSError):
            mapped |= {int(line.split()[4]) for line in maps.read_text().splitlines() if " /dev/shm/" in line}
    assert not [name for name, inode in shm().items() if name not in before and inode not in mapped]


def test_the_watchdog_stops_a_run_that_makes_no_progress_and_shows_what_each_process_was_doing(tmp_path, no_orphans):
    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"config": {"sleep_s": 600}}), num_groups=8)
    spec["watchdog_s"] = 10  # past the stages' start, even on a slow machine
    start = time.monotonic()
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 1 and time.monotonic() - start < 60
    assert summary["failed_stage"] == "watchdog"
    error, [pid] = summary["error"], json.loads((tmp_path / "run" / "pids.slow.0").read_text())
    head = error.split("; what each was doing:\n\n")[0]
    assert re.match(r"no metric line for 1\d s \(watchdog_s 10\): ", head), head
    silences = re.findall(r"(\w+)\.0 \(pid (\d+)\) silent (1\d) s(, no line yet)?", head)  # name, pid, s, none
    assert [s for _, _, s, _ in silences] == sorted((s for _, _, s, _ in silences), reverse=True), head
    assert {(name, none) for name, _, _, none in silences} >= {("sink", ", no line yet")}, head
    assert ("slow", str(pid)) in {(name, p) for name, p, _, _ in silences}, head
    stacks = error.rsplit(f"slow.0 (pid {pid})", 1)[1].split("\n\nsink.0 (pid")[0]  # py-spy's "Sleepy.process
    # (doubles/stages.py:65)" or faulthandler's 'File ".../stages.py", line 65 in process'
    assert "stages.py" in stacks and "process" in stacks, error[-3000:]


def test_stop_when_ends_the_run_cleanly_at_the_first_line_that_meets_it_and_says_when(tmp_path, no_orphans):
    from molt.runtime.pipeline import Pipeline

    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"config": {"sleep_s": 0.5}}), num_groups=64, group_size=4,
                 groups_per_batch=1)  # 64 batches of 4 rows: 32 s
    spec["stop_when"] = {"metric": "sink/rows_in", "at_least": 8}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0 and summary["status"] == "ok" and summary["error"] is None
    stop = summary["stop_when"]
    assert (stop["metric"], stop["at_least"], stop["lower_bound"]) == ("sink/rows_in", 8, False)
    assert 8 <= stop["reached"]["value"] < 256 and 0 < stop["reached"]["time_s"] < summary["wall_s"]
    assert summary["metrics"]["sink/rows_in"] < 256  # stopped long before the source's end
    spec["stop_when"] = {"metric": "sink/rows_in", "at_least": 8, "lower_bound": True}  # no sink/rows_in_stderr
    spec["stages"]["source"]["config"]["num_groups"] = 4
    code, summary = run_spec(spec, tmp_path / "never")
    assert code == 0 and summary["stop_when"]["reached"] is None and summary["metrics"]["sink/rows_in"] == 16
    with pytest.raises(ValueError, match=r"stop_when\.metric: 'sinks/rows_in' names no stage"):
        Pipeline.from_spec({**spec, "stop_when": {"metric": "sinks/rows_in", "at_least": 1}})


def test_stop_when_counts_only_this_starts_lines_and_an_unlogged_target_is_named(tmp_path):
    import logging

    from molt.runtime.pipeline import Pipeline
    from molt.runtime.progress import Progress
    from molt.runtime.targets import warn_unlogged

    spec = chain(num_groups=1)
    spec["stop_when"] = {"metric": "sink/score", "at_least": 0.5}
    (tmp_path / "metrics").mkdir(parents=True)
    progress = Progress(Pipeline.from_spec(spec), tmp_path, live=False)
    line = {"stage": "sink", "replica": 0, "step": 3, "values": {"sink/score": 0.9}}
    with open(tmp_path / "metrics" / "sink.0.jsonl", "w") as f:  # a resumed run's earlier part, then this one's
        f.write(json.dumps({**line, "time": progress.start_unix - 60}) + "\n")
    progress.update(0.0)
    assert progress.reached is None
    with open(tmp_path / "metrics" / "sink.0.jsonl", "a") as f:
        f.write(json.dumps({**line, "time": progress.start_unix + 5}) + "\n")
    progress.update(0.0)
    assert progress.reached == {"value": 0.9, "step": 3, "time_s": 5.0}
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logging.getLogger("molt.runner").addHandler(handler)
    try:
        warn_unlogged(None, "sink/scroe", ["sink/score", "sink/rows_in"])
    finally:
        logging.getLogger("molt.runner").removeHandler(handler)
    [record] = records
    assert record.getMessage().startswith("keep_best: no process logged 'sink/scroe'; closest logged keys: "
                                          "['sink/score'")


def test_keep_best_keeps_the_checkpoint_at_the_best_step_beside_the_newest(tmp_path, no_orphans):
    spec = {"name": "best", "keep_checkpoints": 1, "keep_best": "scorer/score", "stages": {
        "source": {"class": SOURCE, "config": {"num_groups": 6, "groups_per_batch": 1, "checkpoint_every_batches": 1}},
        "scorer": {"class": "tests.doubles.stages.Scorer", "config": {"best_version": 2}}},
        "edges": [{"from": "source", "to": "scorer"}]}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    checkpoints = tmp_path / "run" / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["barrier_2", "barrier_6"]  # the best, the newest
    best = summary["keep_best"]
    assert (best["metric"], best["best"]["value"], best["best"]["step"]) == ("scorer/score", 0, 2)
    assert best["checkpoint"] == str(checkpoints / "barrier_2")


def test_without_py_spy_the_stacks_come_from_faulthandler_in_the_log(tmp_path, monkeypatch):
    from molt.runtime.placement import Proc

    code = "import faulthandler, signal, time; faulthandler.register(signal.SIGUSR1, all_threads=True); time.sleep(60)"
    proc = Proc.start("w", [sys.executable, "-c", code, "molt.runtime.worker"], dict(os.environ), None, tmp_path / "log")
    try:
        time.sleep(1.0)
        monkeypatch.setattr(shutil, "which", lambda name: None)
        text = proc.stacks()
        assert f"process {proc.popen.pid} (sleeping), its log's last 40 lines" in text
        assert 'File "<string>", line 1 in <module>' in text and "Current thread" in text
    finally:
        proc.kill()


def test_a_stop_signal_while_processes_start_is_held_until_they_are_recorded(tmp_path):
    # Python runs a handler that arrives during a fork inside logging's at-fork hook, which swallows the
    # KeyboardInterrupt: 1 in ~10 Ctrl-Cs in a run's first second were lost, the run going on (CI).
    from molt.runtime.placement import Proc, raise_interrupt, stop_signals_deferred

    started = []
    before = signal.signal(signal.SIGINT, raise_interrupt)
    try:
        with pytest.raises(KeyboardInterrupt):
            with stop_signals_deferred():
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.1)  # the handler has run (a pending signal is handled at the next bytecode)
                started.append(Proc.start("sleeper", [sys.executable, "-c", "import time; time.sleep(60)"],
                                          dict(os.environ), None, tmp_path / "log"))
    finally:
        signal.signal(signal.SIGINT, before)
    (proc,) = started
    assert proc.poll() is None
    proc.kill()


def test_a_declared_feedback_edge_still_drains(tmp_path, no_orphans):
    spec = {"name": "fb", "stages": {
        "source": {"class": SOURCE, "config": {"num_groups": 12, "groups_per_batch": 1}},
        "actor": {"class": "tests.doubles.stages.Actor"},
        "learner": {"class": "tests.doubles.stages.Learner"},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "actor.in"}, {"from": "actor", "to": "learner"},
                  {"from": "learner.out", "to": "sink", "record": True},
                  {"from": "learner.weights", "to": "actor.weights", "kind": "broadcast", "feedback": True}]}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary
    rows = recorded_rows(tmp_path / "run", "learner.out--sink.in")
    assert len(rows) == 48
    versions = [r["seen_version"] for r in rows]
    assert versions == sorted(versions) and versions[-1] > 0, "the actor sees new weight versions"


def test_a_torchrun_group_with_checkpoint_barriers(tmp_path, no_orphans):
    pytest.importorskip("torch")
    spec = {"name": "grp", "keep_checkpoints": None, "stages": {
        "source": {"class": SOURCE, "config": {"num_groups": 6, "groups_per_batch": 2, "checkpoint_every_batches": 1}},
        "total": {"class": "tests.doubles.stages.GroupTotal", "world_size": 2},
        "tap": {"class": "tests.doubles.stages.Counter"},
        "sink": {"class": SINK}},
        "edges": [{"from": "source", "to": "total"}, {"from": "total", "to": "sink", "record": True},
                  {"from": "total", "to": "tap"}]}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary
    rows = recorded_rows(tmp_path / "run", "total.out--sink.in")
    assert len(rows) == 24
    assert {r["group_total"] for r in rows} == {16}, "each rank saw the 8-row batch: 2 x 8"
    state = json.loads((tmp_path / "run" / "checkpoints" / "barrier_3" / "tap.0.json").read_text())
    assert state == {"state": {"rows": 24}, "recorded": {}}
    assert json.loads((tmp_path / "run" / "checkpoints" / "barrier_1" / "tap.0.json").read_text())["state"] == {
        "rows": 8}
    total = json.loads((tmp_path / "run" / "checkpoints" / "barrier_2" / "total.0.json").read_text())
    assert total["recorded"] == {"total.out->sink.in": 2}, "rank 0 had recorded two batches at barrier 2"


def test_tcp_edges_bind_to_loopback_and_run_over_curve_with_the_runs_keys(tmp_path, no_orphans):
    from molt.runtime.curve import CurveKeys

    spec = chain(("shape", "stages.shape_reward.ShapeReward", {"replicas": 2}), record_last=True, num_groups=6)
    spec["transport"] = "tcp"
    given = tmp_path / "given.json"
    CurveKeys.generate().write(given)
    spec["curve_keys"] = str(given)
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    wiring = json.loads((tmp_path / "run" / "wiring.json").read_text())
    endpoints = [ep for w in wiring.values() for ep in w["endpoints"]]
    assert endpoints and all(ep.startswith("tcp://127.0.0.1:") for ep in endpoints)
    keys = tmp_path / "run" / "keys" / "curve.json"
    assert {w["curve"] for w in wiring.values()} == {str(keys.resolve())} and "secret" not in json.dumps(wiring)
    assert CurveKeys.read(keys) == CurveKeys.read(given) and keys.stat().st_mode & 0o077 == 0
    assert len(recorded_rows(tmp_path / "run", "shape.out--sink.in")) == 24
    (tmp_path / "bad.json").write_text('{"server_public": "short"}')
    with pytest.raises(ValueError, match=r"bad\.json: CURVE keys \['server_public', 'server_secret'"):
        CurveKeys.read(tmp_path / "bad.json")


def test_a_stage_runs_on_its_cpus_and_results_reach_the_summary(tmp_path, no_orphans):
    import os

    last = sorted(os.sched_getaffinity(0))[-1]
    spec = chain(num_groups=8, groups_per_batch=1)
    spec["stages"]["sink"] = {"class": "tests.doubles.stages.Placement", "cpus": str(last), "replicas": 2,
                              "gpus": "3-4"}
    spec["results"] = {"cpu": "sink/cpus", "threads": "sink/threads", "rows": "sink/rows_in", "absent": "x/y"}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    assert summary["results"] == {"cpu": last, "threads": 1, "rows": 32, "absent": None}
    history = summary["results_history"]  # every reported value, [seconds since the start, value]
    assert history["absent"] == [] and [v for _, v in history["cpu"]] and {v for _, v in history["cpu"]} == {last}
    times = [t for t, _ in history["rows"]]
    assert times == sorted(times) and 0 <= times[0] <= times[-1] <= summary["wall_s"]
    assert summary["metrics"]["sink/num_cpus"] == 1
    seen = {}
    for replica in (0, 1):  # each replica its share of the GPUs
        path = tmp_path / "run" / "metrics" / f"sink.{replica}.jsonl"
        lines = path.read_text().splitlines() if path.exists() else []
        seen[replica] = {json.loads(line)["values"].get("sink/gpu") for line in lines} - {None}
    assert all(gpus <= {3 + r} for r, gpus in seen.items()) and any(seen.values()), seen


def test_cpus_are_parsed_at_load_and_checked_before_any_process_starts(tmp_path):
    """Availability is the launching machine's fact: a worker pinned to CPU 1 loads the saved pipeline
    that names CPU 0 for another stage (the quickstart's replay failed so)."""
    from molt.runtime.pipeline import Pipeline
    from molt.runtime.runner import Runner

    spec = chain(num_groups=1)
    spec["stages"]["sink"]["cpus"] = "zero"
    with pytest.raises(ValueError, match=r"stages.sink.cpus: .zero. is not an id list"):
        Pipeline.from_spec(spec)
    spec["stages"]["sink"]["cpus"] = "0-4096"
    assert Runner(Pipeline.from_spec(spec), tmp_path / "run", live=False).run() == 1
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert re.search(r"stages.sink.cpus: CPU \d+ is not available; this machine offers \[", summary["error"]), summary["error"]
    assert not list((tmp_path / "run" / "logs").iterdir()), "no process started"


def test_the_root_cause_is_an_own_failure_then_a_death_without_status_then_a_consequence(tmp_path):
    """CI saw source.0 named for boom.0's failure: boom's sockets closed before its status was
    written, and the source, sending to it, failed first with 'cannot reach consumer' (a
    ConsumerGoneError, reported as caused by another stage)."""
    from molt.runtime.runner import Runner
    from molt.runtime.worker import write_status

    class FakeProc:
        def __init__(self, name, code):
            self.name, self.code, self.log_path = name, code, tmp_path / f"{name}.log"

        def poll(self):
            return self.code

        def failure(self):
            return f"{self.name} killed by signal SIGKILL"

    runner = Runner.__new__(Runner)
    runner.run_dir, runner.procs = tmp_path, [FakeProc("source.0", 1), FakeProc("boom.0", -9), FakeProc("sink.0", 1)]
    write_status(tmp_path, "source.0", "failed", "cannot reach consumer 'boom.0'", upstream=True)
    write_status(tmp_path, "sink.0", "failed", "upstream stage 'boom' failed", upstream=True)
    assert runner._root_cause() == {"stage": "boom.0", "error": "boom.0 killed by signal SIGKILL"}
    write_status(tmp_path, "boom.0", "failed", "RuntimeError: boom")
    assert runner._root_cause() == {"stage": "boom.0", "error": "RuntimeError: boom", "upstream": False}
    runner.procs = [FakeProc("source.0", 1), FakeProc("sink.0", 1)]
    (tmp_path / "status" / "boom.0.json").unlink()
    assert runner._root_cause()["stage"] == "source.0", "only consequences: the earliest"


def test_stopping_a_stage_that_is_gone_kills_what_it_left_running_in_its_session(tmp_path):
    """A stage killed outright (the OOM killer) leaves its vLLM engine core running in its session; a runner
    that could not poll meanwhile never saw it as a descendant: stopping the stage still kills it."""
    from molt.runtime.placement import Proc

    code = ("import subprocess, sys; p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
            "print(p.pid, flush=True)")
    proc = Proc.start("stage", [sys.executable, "-c", code], dict(os.environ), None, tmp_path / "log")
    proc.popen.wait()  # the stage is gone, its child runs on, unseen by proc.poll
    left = int((tmp_path / "log").read_text().split()[0])
    assert psutil.pid_exists(left) and not proc.descendants
    proc.kill()

    def running() -> bool:
        with contextlib.suppress(psutil.NoSuchProcess):
            return psutil.Process(left).status() != psutil.STATUS_ZOMBIE
        return False

    deadline = time.monotonic() + 10
    while running() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not running()
