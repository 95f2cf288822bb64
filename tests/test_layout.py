"""House rules that a test can hold: import direction, the stage contract, size."""

import ast
import graphlib
import importlib
import inspect
import re
import subprocess
import sys
from pathlib import Path

import pytest

from molt.runtime.stage import Service, Source, Stage, StageConfig, Transform

ROOT = Path(__file__).resolve().parents[1]
STAGE_FILES = sorted(p for p in (ROOT / "stages").glob("*.py") if p.name != "__init__.py")


def test_the_kernel_never_imports_stages():
    for path in (ROOT / "molt").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert not name.startswith("stages"), f"{path.relative_to(ROOT)} imports {name}"


def test_nothing_is_pickled_on_a_data_path():
    pattern = re.compile(r"pickle\.loads?\(|recv_pyobj|send_pyobj")
    for path in [*(ROOT / "molt").rglob("*.py"), *(ROOT / "stages").rglob("*.py")]:
        assert not pattern.search(path.read_text()), f"{path.relative_to(ROOT)} unpickles"


@pytest.mark.parametrize("path", STAGE_FILES, ids=lambda p: p.stem)
def test_every_stage_file_passes_the_stage_contract(path):
    module = importlib.import_module(f"stages.{path.stem}")
    assert module.__doc__, "a stage file starts with a docstring"
    classes = [c for _, c in inspect.getmembers(module, inspect.isclass)
               if issubclass(c, Stage) and c.__module__ == module.__name__]
    assert len(classes) == 1, f"one Stage subclass per file, got {classes}"
    cls = classes[0]
    assert cls.__doc__ and issubclass(cls, (Source, Transform, Service))
    assert issubclass(cls.Config, StageConfig) and cls.Config.model_config.get("extra") == "forbid"
    hooks = {Source: "generate", Transform: "process", Service: "run"}
    kind = next(k for k in hooks if issubclass(cls, k))
    assert getattr(cls, hooks[kind]) is not getattr(kind, hooks[kind]), f"{cls.__name__} must define {hooks[kind]}"
    assert inspect.iscoroutinefunction(cls.run)
    for port in [*cls.inputs.values(), *cls.outputs.values()]:
        assert port.schema is not None or all(isinstance(c, str) or hasattr(c, "type")
                                              for c in (*port.reads, *port.writes))


def test_code_size_is_within_budget():
    out = subprocess.run([sys.executable, str(ROOT / "tools" / "sz.py")], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout


def kernel_imports() -> dict[str, set[str]]:
    """Module -> the molt modules it imports (at any depth of its code, lazy imports included)."""
    modules = {".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__"): p
               for p in (ROOT / "molt").rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = graph.setdefault(name, set())
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom) and node.module in modules:
                subs = {f"{node.module}.{a.name}" for a in node.names} & modules.keys()
                targets.update(subs or {node.module})
        targets.discard(name)
    return graph


def test_the_kernel_has_no_import_circle():
    try:
        tuple(graphlib.TopologicalSorter(kernel_imports()).static_order())
    except graphlib.CycleError as e:
        pytest.fail(f"import circle: {' -> '.join(e.args[1])}")


def test_the_runtime_imports_no_rl_package():
    rl = ("molt.agents", "molt.algorithms", "molt.commands", "molt.engines", "molt.models", "molt.tasks", "molt.train")
    for name, targets in kernel_imports().items():
        if name.startswith("molt.runtime"):
            assert not [t for t in targets if t.startswith(rl)], f"{name} imports {sorted(targets)}"
