"""Checkpoints of a pipeline, taken at aligned barriers, and finding one to resume from.

A replica that has ``Barrier(k)`` on all its inputs has processed exactly what was sent before
it: it saves its state to ``RUN_DIR/checkpoints/barrier_k/`` and forwards the barrier, so the
folder is one consistent cut. Each replica writes ``{stage}.{replica}.json`` (``{"state": ...,
"recorded": {edge: batches}}``) last; the checkpoint is complete once every replica's is there.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

PREFIX = "barrier_"


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step}"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON atomically: under a temporary name, then renamed."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def replica_names(stages: dict[str, int]) -> set[str]:
    """{"a": 2, "b": 1} (id -> replicas) -> {"a.0", "a.1", "b.0"}."""
    return {f"{sid}.{r}" for sid, replicas in stages.items() for r in range(replicas)}


def _barriers(run_dir: Path) -> list[tuple[int, Path]]:
    root = Path(run_dir) / "checkpoints"
    found = root.glob(f"{PREFIX}*") if root.is_dir() else ()
    return [(int(p.name[len(PREFIX):]), p) for p in found if p.name[len(PREFIX):].isdigit()]


def complete_checkpoints(run_dir: Path, names: set[str]) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first."""
    done = [sp for sp in _barriers(run_dir) if all((sp[1] / f"{n}.json").is_file() for n in names)]
    return [p for _, p in sorted(done, key=lambda sp: sp[0])]


def latest_checkpoint(run_dir: Path, names: set[str]) -> Path:
    """The newest complete checkpoint of ``run_dir``.

    Raises:
        ValueError: there is none, naming what the newest incomplete one lacks.
    """
    done = complete_checkpoints(run_dir, names)
    if done:
        return done[-1]
    root = Path(run_dir) / "checkpoints"
    partial = sorted(root.glob(f"{PREFIX}*")) if root.is_dir() else []
    lacks = ""
    if partial:
        missing = sorted(n for n in names if not (partial[-1] / f"{n}.json").is_file())
        lacks = f"; {partial[-1].name} is incomplete (no state of {missing[:4]})"
    raise ValueError(f"--resume {str(run_dir)!r}: no complete checkpoint{lacks}; hint: a source "
                     "emits them with checkpoint_every_batches, and the pipeline must be the same")


def prune_checkpoints(run_dir: Path, names: set[str], keep: int | None,
                      spare: Sequence[Path] = ()) -> list[Path]:
    """Delete complete checkpoints but the newest ``keep`` (None: all) and ``spare``, and the
    incomplete ones older than the newest complete one; returns what was deleted."""
    done = complete_checkpoints(run_dir, names)
    if keep is None or not done:
        return []
    newest = int(done[-1].name[len(PREFIX):])
    stale = [p for p in done[:-keep] if p not in spare] if len(done) > keep else []
    stale += [p for step, p in _barriers(run_dir) if step < newest and p not in done]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def read_replica_state(folder: Path, name: str) -> dict[str, Any]:
    """The JSON replica ``name`` saved in checkpoint ``folder``.

    Raises:
        ValueError: the file is missing.
    """
    path = Path(folder) / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(folder)!r} has no state for {name!r}; hint: resume "
                         "with the same stages and replicas as the run that saved it")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def trainer_checkpoints(run_dir: Path, names: set[str]) -> dict[int, tuple[Path, str]]:
    """Trainer version -> the oldest complete checkpoint at it and the trainer's stage id (the
    stage whose state has ``version``)."""
    found: dict[int, tuple[Path, str]] = {}
    for folder in complete_checkpoints(run_dir, names):
        for name in sorted(names):
            state = read_replica_state(folder, name)["state"]
            if "version" in state:
                found.setdefault(state["version"], (folder, name.rsplit(".", 1)[0]))
    return found


def resumed_version(run_dir: Path) -> int | None:
    """The trainer version a resumed run restarts from; None when not resumed or no trainer."""
    plan = Path(run_dir) / "resume.json"
    if not plan.is_file():
        return None
    folder = Path(json.loads(plan.read_text())["checkpoint"])
    states = [read_replica_state(folder, f.stem)["state"] for f in folder.glob("*.json")]
    return max((s["version"] for s in states if "version" in s), default=None)


def checkpoint_at_version(run_dir: Path, names: set[str], version: int) -> tuple[Path, str]:
    """``trainer_checkpoints(run_dir, names)[version]``.

    Raises:
        ValueError: there is none, listing the versions there are.
    """
    found = trainer_checkpoints(run_dir, names)
    if version not in found:
        raise ValueError(f"{run_dir}: no complete checkpoint at step {version}; got checkpoints at "
                         f"steps {sorted(found)}; hint: keep them with keep_checkpoints: null and "
                         "a source's checkpoint_every_batches")
    return found[version]
