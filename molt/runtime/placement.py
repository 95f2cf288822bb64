"""Where a pipeline's processes run: the YAML's ``placement:`` section.

``backend: local`` (the default): each stage replica is a child process of ``molt run``.
``backend: ray``: each runs under a Ray actor, its launcher, holding the process's resources; a
stage's launchers are reserved at once, or the run fails after ``ready_timeout_s``. On Ray, Ray
assigns the GPUs and the run and working directories must be on a filesystem every node mounts.
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
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Literal

import psutil
from pydantic import BaseModel, ConfigDict, Field

from molt.runtime.stage import SCRATCH_ENV

FORWARDED_ENV = ("MOLT_", "HF_", "VLLM_", "NCCL_")  # passed on by a remote launcher


def parse_ids(text: str, where: str) -> list[int]:
    """A Linux CPU-list string as ids: "0-2,5" -> [0, 1, 2, 5].

    Raises:
        ValueError: malformed or empty.
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
    """``placement.stages.<id>``: what each Ray launcher of the stage asks for."""

    model_config = ConfigDict(extra="forbid")
    num_cpus: float | None = Field(None, ge=0, description="per launcher; None = 0")
    num_gpus: float | None = Field(None, ge=0, description="per launcher; None = share of gpus")
    resources: dict[str, float] = Field(default_factory=dict, description="custom Ray resources")
    nodes: int = Field(1, ge=1, description="nodes a replica's torchrun group spreads over")
    strategy: Literal["PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD"] | None = Field(
        None, description="None = PACK, or STRICT_SPREAD when nodes > 1")


class PlacementSpec(BaseModel):
    """The ``placement:`` section."""

    model_config = ConfigDict(extra="forbid")
    backend: Literal["local", "ray"] = "local"
    address: str | None = Field(None, description="a running Ray cluster ('auto', 'HOST:6379'); "
                                "None = a one-node instance for the run")
    num_cpus: int | None = Field(None, ge=1, description="own instance: CPUs; None = all of ours")
    object_store_mib: int = Field(128, ge=80, description="own instance: object store cap")
    ready_timeout_s: float = Field(300.0, gt=0, description="wait for a stage's resources")
    stages: dict[str, StagePlacement] = Field(default_factory=dict)


class PlacementError(RuntimeError):
    """A backend could not place ``stage``'s processes."""

    def __init__(self, stage: str, message: str) -> None:
        super().__init__(message)
        self.stage = stage


def check_placement(spec: PlacementSpec, world_sizes: dict[str, int], source: str) -> None:
    """Raises ValueError naming the key: ray not installed, or a ``placement.stages.<id>`` not in
    ``world_sizes`` (id -> ranks) or whose ``nodes`` cannot split its ranks."""
    import importlib.util

    if spec.backend == "ray" and importlib.util.find_spec("ray") is None:
        raise ValueError(f"{source}: placement.backend: 'ray' needs the ray package; hint: "
                         "pip install -e '.[ray]' (or pip install ray)")
    for sid, p in spec.stages.items():
        where = f"{source}: placement.stages.{sid}"
        if sid not in world_sizes:
            raise ValueError(f"{where}: no such stage; stages: {sorted(world_sizes)}")
        if p.nodes > 1 and spec.backend == "local":
            raise ValueError(f"{where}.nodes: {p.nodes} nodes need a multi-node backend "
                             "(placement.backend: ray)")
        if p.nodes > 1 and world_sizes[sid] == 1:
            raise ValueError(f"{where}.nodes: spreads a torchrun group's ranks over nodes, and "
                             f"{sid} is one process per replica (world_size 1); hint: replicas "
                             "spread by themselves, nodes is for stages with world_size > 1")
        if world_sizes[sid] % p.nodes:
            raise ValueError(f"{where}.nodes: {p.nodes} nodes do not split world_size "
                             f"{world_sizes[sid]} evenly")


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


_held: list[int] | None = None  # signals held back by stop_signals_deferred; None: not holding


def raise_interrupt(signum: int, frame: object) -> None:
    """SIGINT/SIGTERM handler: raise KeyboardInterrupt, or note the signal while deferred."""
    if _held is not None:
        _held.append(signum)
        return
    raise KeyboardInterrupt


def catch_stop_signals() -> None:
    """SIGINT and SIGTERM raise KeyboardInterrupt; SIGINT explicitly too, since a shell without
    job control starts background commands with SIGINT ignored."""
    signal.signal(signal.SIGINT, raise_interrupt)
    signal.signal(signal.SIGTERM, raise_interrupt)


@contextlib.contextmanager
def stop_signals_deferred(raise_after: bool = True) -> Iterator[list[int]]:
    """Hold SIGINT/SIGTERM back while children start (a KeyboardInterrupt raised in a fork's
    at-fork hook is lost), then raise it if one came and ``raise_after``."""
    global _held
    _held = []
    try:
        yield _held
    finally:
        held, _held = _held, None
        if held and raise_after:
            raise KeyboardInterrupt


def start_child(cpus: list[int] | None, death_signal: int = signal.SIGKILL) -> None:
    """In the child before exec: ``death_signal`` when the parent thread dies
    (PR_SET_PDEATHSIG), and keep to ``cpus``."""
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").prctl(1, death_signal)
    if cpus is not None:
        os.sched_setaffinity(0, cpus)


@dataclass
class Proc:
    """One launched process (a stage replica, or a torchrun launcher) and what it started."""

    name: str
    popen: subprocess.Popen[bytes]
    log_path: Path
    # every descendant seen; psutil refuses to signal a pid reused since
    descendants: dict[int, psutil.Process] = field(default_factory=dict)
    started: float = 0.0  # time.time() before the start: its session's processes started later

    @classmethod
    def start(cls, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None,
              log_path: Path, cwd: str | None = None) -> Proc:
        """Start ``argv`` in its own session, output appended to ``log_path``."""
        started = time.time() - 1.0  # psutil's create_time is exact to a clock tick
        with open(log_path, "ab") as out:
            popen = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd,
                                     start_new_session=True,
                                     preexec_fn=partial(start_child, cpus))
        return cls(name, popen, log_path, started=started)

    @property
    def pid(self) -> int:
        return self.popen.pid

    def poll(self) -> int | None:
        """The exit code, or None while running (noting its descendants, to stop them later)."""
        if self.popen.poll() is None:
            with contextlib.suppress(psutil.Error):
                for child in psutil.Process(self.popen.pid).children(recursive=True):
                    self.descendants.setdefault(child.pid, child)
        return self.popen.poll()

    def terminate(self) -> None:
        if self.poll() is None:
            signal_group(self.popen.pid, signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL its process group, every descendant seen and its session; waits (idempotent)."""
        self.poll()
        if self.popen.poll() is None:
            signal_group(self.popen.pid, signal.SIGKILL)
        self.popen.wait()
        for child in self.descendants.values():
            with contextlib.suppress(psutil.Error):  # NoSuchProcess for a reused pid
                child.kill()
        kill_sessions({self.popen.pid: self.started})

    def stacks(self, log_lines: int = 40) -> str:
        """Its Molt processes' Python stacks, by py-spy, else by SIGUSR1 into the log."""
        spy, out = shutil.which("py-spy"), []
        own = psutil.Process(self.popen.pid) if self.poll() is None else None
        for proc in [own, *self.descendants.values()]:
            with contextlib.suppress(psutil.Error, OSError, subprocess.SubprocessError):
                if proc is None or not _is_worker(proc):
                    continue
                state = f"process {proc.pid} ({proc.status()})"
                if spy:
                    argv = [spy, "dump", "--pid", str(proc.pid)]
                    dump = subprocess.run(argv, capture_output=True, text=True, timeout=20)
                    out.append(f"{state}, py-spy dump:\n{dump.stdout or dump.stderr}")
                else:
                    proc.send_signal(signal.SIGUSR1)
                    time.sleep(1.0)
                    lines = self.log_path.read_text(errors="replace").splitlines()
                    tail = "\n".join(lines[-log_lines:])
                    out.append(f"{state}, its log's last {log_lines} lines (faulthandler's "
                               f"stacks):\n{tail}")
        return "\n".join(out) or f"process {self.popen.pid}: no Molt worker process left to dump"

    def failure(self) -> str:
        code = self.popen.returncode
        how = (f"killed by signal {signal.Signals(-code).name}" if code < 0
               else f"exited with code {code}")
        return f"process {self.popen.pid} {how}; see {self.log_path}"


def _is_worker(proc: psutil.Process) -> bool:
    """Whether ``proc`` is a stage process, not a torchrun launcher (which SIGUSR1 kills)."""
    with contextlib.suppress(psutil.Error):
        argv = proc.cmdline()
        return "molt.runtime.worker" in argv and "torch.distributed.run" not in argv
    return False


def signal_group(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, sig)


SHM_PREFIXES = ("psm_", "sem.mp-", "vllm_")  # multiprocessing's shared memory, semaphores; vLLM's


class Janitor:
    """A process that cleans up after a run, whatever its end (``molt run`` killed outright too):
    every second it notes the run's processes and shared memory (`RunProcesses`); when its pipe
    closes it kills those processes, unlinks those objects and removes the scratch folder."""

    def __init__(self, scratch: Path) -> None:
        import sys

        code = "from molt.runtime.placement import janitor_main; janitor_main()"
        self.popen = subprocess.Popen([sys.executable, "-c", code, str(scratch), repr(time.time())],
                                      stdin=subprocess.PIPE, start_new_session=True)

    def done(self) -> None:
        """``molt run`` stopped its processes: wait for the janitor's cleanup (idempotent)."""
        assert self.popen.stdin is not None
        self.popen.stdin.close()
        self.popen.wait()


def janitor_main() -> None:
    """The `Janitor` process: argv: the scratch folder, the run's start (time.time())."""
    import select
    import sys

    run = RunProcesses(sys.argv[1], float(sys.argv[2]))
    while not select.select([sys.stdin], [], [], 1.0)[0]:  # until the pipe closes
        run.note()
    run.clean()
    shutil.rmtree(sys.argv[1], ignore_errors=True)


class RunProcesses:
    """A run's processes, whatever session they moved to, and the shared memory they made.

    A process is the run's when its environment names the scratch folder (`SCRATCH_ENV`: every
    stage's does, and what it starts inherits it, surviving ``setsid`` and its parent's death), or
    it descends from one (a child started with a cleared environment). An object in /dev/shm is
    the run's when a run process had it open or mapped (by inode: a semaphore is mapped under a
    temporary name), it changed after the run started, and `SHM_PREFIXES` names it.
    """

    def __init__(self, scratch: str, start: float) -> None:
        self.scratch, self.start = scratch, start
        self.procs: dict[int, psutil.Process] = {}
        self.shm: set[int] = set()  # inodes seen

    def note(self) -> list[psutil.Process]:
        """Note the run's processes and the objects they hold now; returns those alive."""
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):  # gone, or not ours to read
                if proc.environ().get(SCRATCH_ENV) == self.scratch:
                    self.procs |= {p.pid: p for p in [proc, *proc.children(recursive=True)]}
        alive = []
        for proc in self.procs.values():
            with contextlib.suppress(psutil.Error):
                if proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE:
                    self.shm |= shm_held(proc.pid)
                    alive.append(proc)
        return alive

    def clean(self, timeout_s: float = 30.0) -> None:
        """SIGKILL the run's processes until none is left (or ``timeout_s``), then unlink its
        shared-memory objects."""
        deadline = time.monotonic() + timeout_s
        while (alive := self.note()) and time.monotonic() < deadline:
            for proc in alive:
                with contextlib.suppress(psutil.Error):
                    proc.kill()
            psutil.wait_procs(alive, timeout=1.0)
        for entry in os.scandir("/dev/shm") if os.path.isdir("/dev/shm") else ():
            with contextlib.suppress(OSError):  # gone meanwhile
                st = entry.stat(follow_symlinks=False)
                if (entry.name.startswith(SHM_PREFIXES) and st.st_ino in self.shm
                        and st.st_ctime >= self.start):
                    os.unlink(entry.path)


def shm_held(pid: int) -> set[int]:
    """Inodes of the /dev/shm files process ``pid`` has open or mapped."""
    held = set()
    with contextlib.suppress(OSError):  # gone, or not ours to read
        for fd in os.scandir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                if os.readlink(fd.path).startswith("/dev/shm/"):
                    held.add(os.stat(fd.path).st_ino)
        with open(f"/proc/{pid}/maps") as maps:  # address perms offset dev inode [path]
            held |= {int(f[4]) for f in map(str.split, maps) if f[5:] and f[5][:9] == "/dev/shm/"}
    return held


def kill_sessions(sessions: dict[int, float]) -> None:
    """SIGKILL every process of ``sessions`` (id -> leader's start time) started after it."""
    for proc in psutil.process_iter(["create_time"]):
        with contextlib.suppress(OSError, psutil.Error):
            leader = os.getsid(proc.pid)
            if leader in sessions and proc.info["create_time"] >= sessions[leader]:
                proc.kill()


@dataclass
class LocalSlot:
    """A place on this host."""

    backend: LocalBackend
    address: str | None = None  # None: edges bind to the pipeline's host, torchrun to loopback

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None,
              log_path: Path, scratch: Path) -> Proc:
        import sys

        if self.backend.janitor is None:
            self.backend.janitor = Janitor(scratch)
        return Proc.start(name, [sys.executable, *argv], {**os.environ, **env}, cpus, log_path)


class LocalBackend:
    """Every process a child of ``molt run``, a `Janitor` cleaning up after them."""

    def __init__(self) -> None:
        self.janitor: Janitor | None = None

    def reserve(self, sid: str, replicas: int, nodes: int) -> list[list[LocalSlot]]:
        return [[LocalSlot(self)] for _ in range(replicas)]

    def close(self, scratch: Path) -> None:
        if self.janitor is not None:
            self.janitor.done()
        shutil.rmtree(scratch, ignore_errors=True)
