"""Starts, wires, supervises and stops the processes of a pipeline (``molt run``).

Run directory: ``pipeline.yaml`` (resolved), ``wiring.json``, ``logs/``, ``metrics/`` (merged into
``metrics.jsonl``), ``status/``, ``record/``, ``checkpoints/``, ``summary.json``. ``resume=True``
continues a stopped run from its newest complete checkpoint; ``resume=FOLDER`` starts a new run
from that checkpoint of another run.

Healthy drain: sources finish and send end of stream; a stage ends when every producer of each
non-broadcast input has ended (so broadcast feedback edges never block it), flushes, sends end of
stream and exits 0. The runner waits until every process has exited 0 (or ``stop_when`` is met),
then writes the summary.

Crash: a stage that raises sends an error frame downstream, writes its traceback to ``status/``
and exits 1. On the first non-zero exit or the watchdog, the runner sends SIGTERM to every
process group, SIGKILL after ``stop_timeout_s``, and reports the root cause, the earliest failure
not caused by another stage; exit 1. Ctrl-C or SIGTERM stops the same way (exit 130; a second one
kills at once). Stage processes die with the runner (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import yaml

from molt.runtime.checkpoint import (latest_checkpoint, prune_checkpoints, replica_names,
                                     trainer_checkpoints)
from molt.runtime.curve import CurveKeys
from molt.runtime.metrics import get_logger
from molt.runtime.pipeline import Pipeline
from molt.runtime.placement import LocalBackend, PlacementError, free_port, stop_signals_deferred
from molt.runtime.progress import Progress
from molt.runtime.stage import SCRATCH_ENV, scratch_folder
from molt.runtime.targets import warn_unlogged

log = get_logger("runner")


TcpHost = Callable[[str, int], tuple[str, Callable[[str], int]]]


def make_wiring(pipe: Pipeline, run_dir: Path, sock_dir: Path,
                tcp_host: TcpHost | None = None) -> dict[str, Any]:
    """Each edge's endpoints, one per producer replica (``ipc://`` in ``sock_dir``; tcp at
    ``tcp_host(stage, replica)``: an address and its free-port function), and consumer ids."""
    curve = None
    if pipe.spec.transport == "tcp" and pipe.spec.curve:
        keys_file, path = pipe.spec.curve_keys, run_dir.resolve() / "keys" / "curve.json"
        (CurveKeys.read(keys_file) if keys_file else CurveKeys.generate()).write(path)
        curve = str(path)
    elif pipe.spec.transport == "tcp":
        log.warning("tcp edges without CURVE (curve: false): any peer that reaches %s can read "
                    "and inject batches", pipe.spec.host)
    wiring = {}
    for e in pipe.edges:
        num_producers, num_consumers = pipe.stages[e.src].replicas, pipe.stages[e.dst].replicas
        if pipe.spec.transport == "tcp":
            hosts = [tcp_host(e.src, i) if tcp_host else (pipe.spec.host, free_port)
                     for i in range(num_producers)]
            endpoints = [f"tcp://{host}:{port(host)}" for host, port in hosts]
        else:
            endpoints = [f"ipc://{sock_dir}/e{e.index}.{i}" for i in range(num_producers)]
        wiring[e.name] = {"endpoints": endpoints, "curve": curve,
                          "consumers": [f"{e.dst}.{j}" for j in range(num_consumers)]}
    return wiring


class Runner:
    """Runs a validated pipeline in ``run_dir``; ``run()`` returns the exit code."""

    def __init__(self, pipe: Pipeline, run_dir: Path, live: bool | None = None,
                 resume: bool | Path = False) -> None:
        self.pipe, self.run_dir, self.resume = pipe, Path(run_dir), resume
        self.replica_names = replica_names(pipe.checkpointed())
        self.procs: list[Any] = []  # molt.runtime.placement.Proc, or the Ray backend's RayProc
        self.live = sys.stderr.isatty() if live is None else live
        self.failure: dict[str, Any] | None = None
        self.start_s, self.start_unix = time.monotonic(), time.time()
        self.scratch: Path | None = None
        self.backend: Any = None

    def start(self) -> None:
        """Write the config, reserve every process's place, write the wiring, start them all."""
        if self.resume:
            self._prepare_resume()
        for sub in ("logs", "metrics", "status"):
            (self.run_dir / sub).mkdir(parents=True, exist_ok=True)
        resolved = yaml.safe_dump(self.pipe.to_dict(), sort_keys=False)
        (self.run_dir / "pipeline.yaml").write_text(resolved)
        placement = self.pipe.spec.placement
        if placement.backend == "ray":
            from molt.runtime.ray import RayBackend

            self.backend = RayBackend(placement, self.pipe)
        else:  # checked here, not at load: a worker pinned to its CPUs loads the pipeline too
            self.backend = LocalBackend()
            for sid, node in self.pipe.stages.items():
                if missing := sorted(set(node.cpus or ()) - os.sched_getaffinity(0)):
                    raise PlacementError(sid, f"{self.pipe.source}: stages.{sid}.cpus: CPU "
                                         f"{missing[0]} is not available; this machine offers "
                                         f"{sorted(os.sched_getaffinity(0))}")
        # made after the backend, whose close() removes it once every process is gone
        self.scratch = scratch_folder("molt-run-")
        owners = list(reversed(self.pipe.topo_order()))
        slots = {sid: self.backend.reserve(sid, self.pipe.stages[sid].replicas, self._nodes(sid))
                 for sid in owners}
        tcp_host = None
        if placement.backend == "ray" and (remote := self.backend.remote_stage(slots)):
            if self.pipe.spec.transport != "tcp":
                raise PlacementError(remote, f"{self.pipe.source}: stages.{remote}: Ray placed it "
                                     "on another node than molt run; ipc edges stay on one host: "
                                     "set transport: tcp")
            tcp_host = lambda sid, r: (slots[sid][r][0].address,  # noqa: E731
                                       slots[sid][r][0].free_port)
        wiring = make_wiring(self.pipe, self.run_dir, self.scratch / "sock", tcp_host)
        (self.run_dir / "wiring.json").write_text(json.dumps(wiring, indent=1))
        for sid in owners:
            for r, replica_slots in enumerate(slots[sid]):
                with stop_signals_deferred():  # a Ctrl-C now stops this replica too
                    self.procs += self._launch(sid, r, replica_slots)

    def _nodes(self, sid: str) -> int:
        placed = self.pipe.spec.placement.stages.get(sid)
        return placed.nodes if placed else 1

    def _prepare_resume(self) -> None:
        """Name the checkpoint in ``resume.json``; a given folder is not strict and starts the
        recordings afresh."""
        explicit = isinstance(self.resume, Path)
        folder = (self.resume if isinstance(self.resume, Path)
                  else latest_checkpoint(self.run_dir, self.replica_names))
        self.run_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "resume.json").write_text(json.dumps(
            {"checkpoint": str(folder.resolve()), "strict": not explicit,
             "keep_records": not explicit}))
        for old in (self.run_dir / "status").glob("*.json"):
            old.unlink()
        log.info("resuming %s from %s", self.run_dir, folder.name)

    def _launch(self, sid: str, replica: int, slots: list[Any]) -> list[Any]:
        """Start a replica's process in each of its slots (one per node of a torchrun group);
        ``--standalone`` on one node binds a port of the OS's choice, which none can take."""
        node = self.pipe.stages[sid]
        worker = ["-m", "molt.runtime.worker", str(self.run_dir.resolve()), sid, str(replica)]
        argvs = [worker]
        if node.world_size > 1:
            master = slots[0].address or "127.0.0.1"
            rendezvous = ["--standalone"] if len(slots) == 1 else [
                f"--nnodes={len(slots)}", f"--master-addr={master}",
                f"--master-port={slots[0].free_port(master)}"]
            per_node = node.world_size // len(slots)
            torchrun = ["-m", "torch.distributed.run", f"--nproc-per-node={per_node}", *rendezvous]
            argvs = [[*torchrun, f"--node-rank={k}", *worker] for k in range(len(slots))]
        # custom stages are imported relative to where `molt run` was started
        path = os.pathsep.join(p for p in (os.getcwd(), os.environ.get("PYTHONPATH", "")) if p)
        env = {"PYTHONUNBUFFERED": "1", "PYTHONPATH": path, SCRATCH_ENV: str(self.scratch)}
        if node.gpus is not None and isinstance(self.backend, LocalBackend):  # Ray assigns GPUs
            share = len(node.gpus) // node.replicas  # replica r: the r-th equal share
            gpus = node.gpus[replica * share:(replica + 1) * share]
            env["CUDA_VISIBLE_DEVICES"] = ",".join(map(str, gpus))
        if node.cpus is not None:
            env["OMP_NUM_THREADS"] = str(max(1, len(node.cpus) * len(slots) // node.world_size))
            env["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, node.cpus))
        logs = self.run_dir / "logs"
        assert self.scratch is not None
        return [slot.start(f"{sid}.{replica}", argv, env, node.cpus,
                           logs / f"{sid}.{replica}{f'.node{k}' if k else ''}.log", self.scratch)
                for k, (slot, argv) in enumerate(zip(slots, argvs))]

    def supervise(self, progress: Progress) -> None:
        """Poll until every process has exited 0, or one failed (sets ``failure``)."""
        polls = 0
        while True:
            progress.update(time.monotonic() - self.start_s)
            if (polls := polls + 1) % 10 == 0:
                self._prune(progress)
            codes = [p.poll() for p in self.procs]
            if any(c not in (None, 0) for c in codes):
                self.failure = self._root_cause()
                return
            if all(c == 0 for c in codes) or self._stalled():
                return
            stop = self.pipe.spec.stop_when
            if (reached := progress.reached) is not None and stop is not None:
                log.info("stop_when met: %s %g at step %s, %.1f s after the start; stopping the "
                         "run", stop.metric, reached["value"], reached["step"], reached["time_s"])
                return
            time.sleep(0.2)

    def _stalled(self) -> bool:
        """True, with each running process's silence and stacks in ``failure``, when no metric
        line was written for ``watchdog_s``. Silence counts from a process's last line, else
        from the start; the longest silent comes first, upstream first on a tie."""
        limit, metrics = self.pipe.spec.watchdog_s, self.run_dir / "metrics"
        written = {f.stem: f.stat().st_mtime for f in metrics.glob("*.jsonl") if f.stat().st_size}
        last = {p.name: max(written.get(p.name, 0.0), written.get(f"{p.name}.rank0", 0.0))
                for p in self.procs}
        silent_s = {name: time.time() - max(t, self.start_unix) for name, t in last.items()}
        if limit is None or min(silent_s.values()) < limit:
            return False
        order = self.pipe.topo_order()
        running = sorted((p for p in self.procs if p.poll() is None), key=lambda p: (
            -round(silent_s[p.name]), order.index(p.name.rpartition(".")[0])))
        heads = [f"{p.name} (pid {p.pid}) silent {silent_s[p.name]:.0f} s"
                 + ("" if last[p.name] > self.start_unix else ", no line yet") for p in running]
        head = f"no metric line for {min(silent_s.values()):.0f} s (watchdog_s {limit:g})"
        log.error("%s: %s; dumping their stacks, then stopping", head, "; ".join(heads))
        report = "\n\n".join(f"{h}:\n{p.stacks()}" for h, p in zip(heads, running))
        self.failure = {"stage": "watchdog", "error": f"{head}: {'; '.join(heads)}; what each "
                        f"was doing:\n\n{report}"}
        return True

    def run(self) -> int:
        """start + supervise + stop; returns 0, 1 (failed) or 130 (SIGINT or SIGTERM)."""
        self.start_s, self.start_unix = time.monotonic(), time.time()
        with Progress(self.pipe, self.run_dir, self.live) as progress:
            try:
                self.start()
                self.supervise(progress)
            except PlacementError as e:
                self.failure = {"stage": e.stage, "error": str(e)}
            except KeyboardInterrupt:
                log.warning("interrupted: stopping %d process(es)", len(self.procs))
                self.failure = {"stage": None,
                                "error": "interrupted by a signal (SIGINT or SIGTERM)"}
            finally:  # a second Ctrl-C hurries the stop and never breaks it off
                with stop_signals_deferred(raise_after=False) as again:
                    self.stop(hurry=again)
                    if self.backend is not None and self.scratch is not None:
                        self.backend.close(self.scratch)
                    progress.update(time.monotonic() - self.start_s)
                    wall_s = time.monotonic() - self.start_s
                    code = self._finish(progress, wall_s, self._prune(progress))
            return code

    def _prune(self, progress: Progress) -> Path | None:
        """Keep the newest ``keep_checkpoints``, the best one and those not evaluated yet;
        returns the best's."""
        found = (trainer_checkpoints(self.run_dir, self.replica_names)
                 if self.pipe.spec.keep_best else {})
        best = found.get(progress.best["step"], (None,))[0] if progress.best else None
        pending = [folder for v, (folder, _) in found.items() if v > progress.best_logged_step]
        prune_checkpoints(self.run_dir, self.replica_names, self.pipe.spec.keep_checkpoints,
                          pending + ([best] if best else []))
        return best

    def stop(self, hurry: Sequence[int] = ()) -> None:
        """SIGTERM, then SIGKILL every process after ``stop_timeout_s``, or once ``hurry`` (the
        stop signals that came meanwhile) is not empty; idempotent."""
        for p in self.procs:
            p.terminate()
        deadline = time.monotonic() + self.pipe.spec.stop_timeout_s
        while (time.monotonic() < deadline and not hurry
               and any(p.poll() is None for p in self.procs)):
            time.sleep(0.05)
        if hurry:
            log.warning("a second stop signal: killing every process without waiting")
        for p in self.procs:
            p.kill()

    def _root_cause(self) -> dict[str, Any]:
        statuses = []
        for f in sorted((self.run_dir / "status").glob("*.json")):
            s = json.loads(f.read_text())
            if s["state"] == "failed":
                statuses.append({"stage": f.stem, **s})
        # 1) a stage's own failure  2) a process that died without a status (SIGKILL, a launcher)
        # 3) failures caused by another stage (upstream errors, consumers gone)
        own = [s for s in statuses if not s["upstream"]]
        reported = {s["stage"].split(".rank")[0] for s in statuses}
        dead = [p for p in self.procs if p.poll() not in (None, 0) and p.name not in reported]
        if not own and dead:
            return {"stage": dead[0].name, "error": dead[0].failure() + _log_tail(dead[0].log_path)}
        first = min(own or statuses, key=lambda s: s["time"])
        return {"stage": first["stage"], "error": first["error"], "upstream": first["upstream"]}

    def _finish(self, progress: Progress, wall_s: float, best: Path | None) -> int:
        failure = self.failure or {}
        status = "ok" if not failure else "interrupted" if failure["stage"] is None else "failed"
        metrics = progress.summary()
        results = {name: metrics.get(key) for name, key in self.pipe.spec.results.items()}
        # the replicas' files are read one after another: order by time
        history = {name: sorted(progress.history[key], key=lambda tv: tv[0])
                   for name, key in self.pipe.spec.results.items()}
        summary = {"status": status, "wall_s": round(wall_s, 3),
                   "failed_stage": failure.get("stage"), "error": failure.get("error"),
                   "results": results, "results_history": history, "metrics": metrics}
        warn_unlogged(self.pipe.spec.stop_when, self.pipe.spec.keep_best, metrics)
        if (stop := self.pipe.spec.stop_when) is not None:
            summary["stop_when"] = {**stop.model_dump(), "reached": progress.reached}
        if self.pipe.spec.keep_best is not None:
            summary["keep_best"] = {"metric": self.pipe.spec.keep_best, "best": progress.best,
                                    "checkpoint": None if best is None else str(best)}
        (self.run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
        if status == "ok":
            log.info("run finished in %.1f s: %s", wall_s, self.run_dir)
            return 0
        if status == "interrupted":
            log.warning("run interrupted after %.1f s; every process stopped: %s", wall_s,
                        self.run_dir)
            return 130
        peer = (" on what a peer sent it (no stage failed on its own)"
                if failure.get("upstream") else "")
        what = ("the watchdog stopped the run" if failure["stage"] == "watchdog"
                else f"stage {failure['stage']} failed{peer}")
        log.error("%s; run stopped (%s)\n%s", what, self.run_dir, failure["error"])
        return 1


def _log_tail(path: Path, lines: int = 12) -> str:
    """The last ``lines`` lines of a log; empty when unreadable."""
    try:
        tail = path.read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return ""
    return "\n" + "\n".join(tail) if tail else ""


def default_run_dir(pipe: Pipeline) -> Path:
    """``runs/{name}-{YYYYmmdd-HHMMSS}`` unless the pipeline names one."""
    if pipe.spec.run_dir:
        return Path(pipe.spec.run_dir)
    return Path("runs") / f"{pipe.spec.name}-{time.strftime('%Y%m%d-%H%M%S')}"
