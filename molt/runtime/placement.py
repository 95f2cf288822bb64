"""Where a pipeline's processes run: the YAML's ``placement:`` section (used by molt.runtime.runner).

``backend: local`` (the default): each stage replica is a child process of ``molt run``
on this host (a torchrun launcher for a group). ``backend: ray``: each one runs under a
Ray actor, its *launcher*, that holds the process's resources on a Ray cluster
(https://docs.ray.io); nothing else in the YAML changes. The data plane stays ZeroMQ:
Ray places processes, it carries no batch.

Ray: ``address`` names a running cluster ("auto": the one ``ray start`` began on this
node); without it ``molt run`` starts a one-node instance (``num_cpus``, an object store
capped at ``object_store_mib``) and stops it at the end. A launcher asks for
``num_cpus`` (default: the length of the stage's ``cpus``, else 0), ``num_gpus``
(default: its share of ``gpus``, else 0) and any custom ``resources``; a stage that asks
for something reserves all its launchers at once as one placement group (``strategy``),
so a run holds every engine and trainer slot before anything starts, or fails after
``ready_timeout_s`` naming the stage. ``nodes: N`` spreads a torchrun group's
``world_size`` ranks over N launchers (STRICT_SPREAD: one per node, unless ``strategy``
says otherwise), joined by torchrun's static rendezvous at the first launcher's address.

On Ray, the CPU ids of ``cpus`` are applied on whichever node a process lands (as
locally) but GPU ids are not: Ray assigns the GPUs (CUDA_VISIBLE_DEVICES). The run
directory and the working directory must lie on a filesystem every node mounts (as on a
Slurm cluster). A process's environment is its node's, plus Molt's variables and the
runner's ``MOLT_*``, ``HF_*``, ``VLLM_*`` and ``NCCL_*`` ones. When processes span
nodes, tcp edges bind to the producer node's address (the one Ray uses) and ipc edges
are refused. Failure semantics are the local ones: a launcher that dies (its actor
killed, its node lost) fails the run naming its stage replica, and its process dies
with it (PR_SET_PDEATHSIG).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from functools import partial
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field

FORWARDED_ENV = ("MOLT_", "HF_", "VLLM_", "NCCL_")  # the runner's variables a remote launcher passes on


def parse_ids(text: str, where: str) -> list[int]:
    """Ids of a Linux CPU-list string: "0-2,5" -> [0, 1, 2, 5].

    Raises:
        ValueError: malformed or empty (``where`` names the YAML key).
    """
    ids: list[int] = []
    try:
        for part in text.split(","):
            low, _, high = part.strip().partition("-")
            ids += range(int(low), int(high or low) + 1)
    except ValueError:
        raise ValueError(f"{where}: {text!r} is not an id list such as '0' or '0-1,3'") from None
    if not ids:
        raise ValueError(f"{where}: {text!r} names no id")
    return sorted(set(ids))


class StagePlacement(BaseModel):
    """``placement.stages.<id>``: what each of a stage's launchers asks of Ray (ignored locally but ``nodes``)."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float | None = Field(None, ge=0, description="CPUs per launcher; None = len(cpus), else 0")
    num_gpus: float | None = Field(None, ge=0, description="GPUs per launcher; None = its share of gpus, else 0")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources per launcher")
    nodes: int = Field(1, ge=1, description="launchers (nodes) a replica's torchrun group spreads over")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="the stage's placement group; None = PACK, or STRICT_SPREAD when nodes > 1")


class PlacementSpec(BaseModel):
    """The ``placement:`` section."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["local", "ray"] = "local"
    address: str | None = Field(None, description="ray: a running cluster ('auto', 'HOST:6379'); "
                                "None = start a one-node instance for the run")
    num_cpus: int | None = Field(None, ge=1, description="ray, own instance: its CPUs; None = this process's")
    object_store_mib: int = Field(128, ge=80, description="ray, own instance: object store cap (Molt puts nothing there)")
    ready_timeout_s: float = Field(300.0, gt=0, description="ray: wait this long for a stage's resources")
    stages: dict[str, StagePlacement] = Field(default_factory=dict)


class PlacementError(RuntimeError):
    """A backend could not place ``stage``'s processes; the run fails naming it."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def check_placement(spec: PlacementSpec, world_sizes: dict[str, int], source: str) -> None:
    """Raises ValueError naming ``placement.backend`` when ray is not installed, or
    ``placement.stages.<id>`` for a stage not in ``world_sizes`` (stage id -> torchrun ranks),
    a ``nodes`` that does not divide its ``world_size``, or ``nodes > 1`` on the local backend."""
    import importlib.util

    if spec.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError(f"{source}: placement.backend: 'ray' needs the ray package; hint: "
                         "pip install -e '.[ray]' (or pip install ray)")
    for sid, p in spec.stages.items():
        where = f"{source}: placement.stages.{sid}"
        if sid not in world_sizes:
            raise ValueError(f"{where}: no such stage; stages: {sorted(world_sizes)}")
        if p.nodes > 1 and spec.backend == "local":
            raise ValueError(f"{where}.nodes: {p.nodes} nodes need a multi-node backend (placement.backend: ray)")
        if p.nodes > 1 and world_sizes[sid] == 1:
            raise ValueError(f"{where}.nodes: spreads a torchrun group's ranks over nodes, and {sid} is one process "
                             f"per replica (world_size 1); hint: replicas spread by themselves, nodes is for "
                             "stages with world_size > 1")
        if world_sizes[sid] % p.nodes:
            raise ValueError(f"{where}.nodes: {p.nodes} nodes do not split world_size {world_sizes[sid]} evenly")


def free_port(host: str) -> int:
    """A TCP port free on ``host`` now (the OS's choice)."""
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_held: list[int] | None = None  # stop signals held back by stop_signals_deferred; None: not holding


def raise_interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM handler of ``molt run`` and ``molt sweep``: raise KeyboardInterrupt,
    or note the signal inside ``stop_signals_deferred``."""
    if _held is not None:
        _held.append(signum)
        return
    raise KeyboardInterrupt


def catch_stop_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt (``raise_interrupt``); SIGINT explicitly too:
    a shell without job control starts background commands with SIGINT ignored, and Python
    keeps an inherited SIG_IGN, so Ctrl-C/`kill -INT` would do nothing."""
    signal.signal(signal.SIGINT, raise_interrupt)
    signal.signal(signal.SIGTERM, raise_interrupt)


@contextlib.contextmanager
def stop_signals_deferred(raise_after: bool = True) -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM (``raise_interrupt``) back while child processes are started and
    recorded; KeyboardInterrupt at the end of the block if one came (unless not ``raise_after``:
    a stop sequence, which reads the yielded list of held signals to hurry instead).

    Arriving during a fork, Python runs the handler inside an at-fork hook (logging's), which
    swallows the KeyboardInterrupt it raises: the Ctrl-C is lost and the run goes on (seen in
    about 1 of 10 interrupts in a run's first second).
    """
    global _held
    _held = []
    try:
        yield _held
    finally:
        held, _held = _held, None
        if held and raise_after:
            raise KeyboardInterrupt


def start_child(cpus: list[int] | None, death_signal: int = signal.SIGKILL) -> None:
    """In the child before exec: ``death_signal`` when the parent thread dies (Linux
    PR_SET_PDEATHSIG), and keep to ``cpus`` (inherited by everything the child starts)."""
    try:
        ctypes.CDLL("libc.so.6").prctl(1, death_signal)
    except OSError:
        pass
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


@dataclass
class Proc:
    """One launched OS process (a stage replica, or a torchrun launcher) and what it started."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    # every descendant seen, by identity (pid and start time: psutil refuses to signal a pid reused since)
    descendants: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = 0.0  # time.time() just before the start: its session's processes started later

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None, log_path: Path,
              cwd: str | None = None) -> Proc:
        """Start ``argv`` in its own session, output appended to ``log_path``."""
        started = time.time() - 1.0  # psutil's create_time is exact to a clock tick
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True, preexec_fn=partial(start_child, cpus))
        return cls(name, popen, log_path, started=started)

    def poll(self) -> int | None:
        """The exit code, or None while running (and note its descendants, to stop strays later)."""
        if self.popen.poll() is None:
            try:
                for child in psutil.Process(self.popen.pid).children(recursive=True):
                    self.descendants.setdefault(child.pid, child)
            except psutil.Error:
                pass
        return self.popen.poll()

    def terminate(self) -> None:
        """SIGTERM to its process group, if it runs."""
        if self.poll() is None:
            _signal_group(self.popen.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL to its process group, to every descendant that left it and still runs as the
        process seen (a pid that an unrelated process took since is left alone), and to whatever still
        runs in its session, seen or not (a vLLM engine core outliving its stage, killed by the OOM
        killer, while the runner could not poll); waits (idempotent)."""
        self.poll()
        if self.popen.poll() is None:
            _signal_group(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        for child in self.descendants.values():
            try:
                child.kill()  # psutil checks (pid, start time) first: NoSuchProcess for a reused pid
            except psutil.Error:
                pass
        kill_sessions({self.popen.pid: self.started})

    def stacks(self, log_lines: int = 40) -> str:
        """Its Molt processes' Python stacks, as text: ``py-spy dump`` where py-spy is on the PATH (any
        process, even a stopped one), else faulthandler's (the worker dumps on SIGUSR1 into its log)."""
        spy, out = shutil.which("py-spy"), []
        for proc in [psutil.Process(self.popen.pid) if self.poll() is None else None, *self.descendants.values()]:
            with contextlib.suppress(psutil.Error, OSError, subprocess.SubprocessError):
                if proc is None or not _is_worker(proc):
                    continue
                state = f"process {proc.pid} ({proc.status()})"
                if spy:
                    dump = subprocess.run([spy, "dump", "--pid", str(proc.pid)], capture_output=True, text=True,
                                          timeout=20)
                    out.append(f"{state}, py-spy dump:\n{dump.stdout or dump.stderr}")
                else:
                    proc.send_signal(signal.SIGUSR1)
                    time.sleep(1.0)
                    tail = "\n".join(self.log_path.read_text(errors="replace").splitlines()[-log_lines:])
                    out.append(f"{state}, its log's last {log_lines} lines (faulthandler's stacks):\n{tail}")
        return "\n".join(out) or f"process {self.popen.pid}: no Molt worker process left to dump"

    def failure(self) -> str:
        code = self.popen.returncode
        how = f"killed by signal {signal.Signals(-code).name}" if code < 0 else f"exited with code {code}"
        return f"process {self.popen.pid} {how}; see {self.log_path}"


def _is_worker(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a stage process (``python -m molt.runtime.worker``, which dumps its stacks on SIGUSR1)."""
    with contextlib.suppress(psutil.Error):  # a torchrun launcher names molt.runtime.worker too, and dies of SIGUSR1
        argv = proc.cmdline()
        return "molt.runtime.worker" in argv and "torch.distributed.run" not in argv
    return False


def _signal_group(pid: int, sig: signal.Signals) -> None:
    try:
        os.killpg(pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


class Janitor:
    """A process of its own that cleans up after a ``molt run`` killed outright (SIGKILL, the OOM
    killer), which cannot clean up itself: its stage processes die with it (PR_SET_PDEATHSIG), but
    not what they started (vLLM's engine core and workers, a resource tracker), nor the scratch folder.

    Told each local process as it starts (`watch`: its pid, which is its session id, and start
    time), the janitor waits on a pipe from ``molt run``; when the pipe closes without `done`,
    ``molt run`` is gone, and it kills every process still in those sessions (started after their
    leader) and removes the scratch folder. It runs in a session of its own, so a Ctrl-C at the
    terminal does not reach it.
    """

    def __init__(self, scratch: Path) -> None:
        import sys

        self.popen = subprocess.Popen([sys.executable, "-c", "from molt.runtime.placement import janitor_main; janitor_main()",
                                       str(scratch)], stdin=subprocess.PIPE, text=True, start_new_session=True)

    def watch(self, proc: Proc) -> None:
        assert self.popen.stdin is not None
        with contextlib.suppress(psutil.Error):  # gone already: nothing of it to clean up
            self.popen.stdin.write(f"{proc.popen.pid} {psutil.Process(proc.popen.pid).create_time()}\n")
            self.popen.stdin.flush()

    def done(self) -> None:
        """``molt run`` stopped its processes itself: the janitor leaves (idempotent)."""
        if self.popen.stdin is not None and not self.popen.stdin.closed:
            self.popen.stdin.write("done\n")
            self.popen.stdin.close()
        self.popen.wait()


def janitor_main() -> None:
    """The `Janitor` process: ``python -c ... SCRATCH``, sessions on stdin, ``done`` to leave."""
    import sys

    sessions: dict[int, float] = {}
    for line in sys.stdin:
        if line == "done\n":
            return
        pid, started = line.split()
        sessions[int(pid)] = float(started)
    kill_sessions(sessions)  # molt run is gone without saying done
    shutil.rmtree(sys.argv[1], ignore_errors=True)


def kill_sessions(sessions: dict[int, float]) -> None:
    """SIGKILL every process in one of ``sessions`` (the session id, its leader's pid -> the time it
    started) that started after its leader did, whether the leader still runs or not."""
    for proc in psutil.process_iter(["create_time"]):
        with contextlib.suppress(OSError, psutil.Error):
            if (leader := os.getsid(proc.pid)) in sessions and proc.info["create_time"] >= sessions[leader]:
                proc.kill()


@dataclass
class LocalSlot:
    """Where a local process runs: this host."""

    backend: LocalBackend
    address: str | None = None  # None: edges bind to the pipeline's ``host``, torchrun to loopback

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None, log_path: Path,
              scratch: Path) -> Proc:
        import sys

        if self.backend.janitor is None:
            self.backend.janitor = Janitor(scratch)
        proc = Proc.start(name, [sys.executable, *argv], {**os.environ, **env}, cpus, log_path)
        self.backend.janitor.watch(proc)
        return proc


class LocalBackend:
    """Every process a child of ``molt run`` on this host, a `Janitor` watching them."""

    def __init__(self) -> None:
        self.janitor: Janitor | None = None

    def reserve(self, sid: str, replicas: int, nodes: int) -> list[list[LocalSlot]]:
        return [[LocalSlot(self)] for _ in range(replicas)]

    def close(self, scratch: Path) -> None:
        if self.janitor is not None:
            self.janitor.done()
        shutil.rmtree(scratch, ignore_errors=True)
