"""Checkpoints of a whole pipeline, taken at aligned barriers, and finding one to resume.

A source emits ``Barrier(k)`` in-band (``checkpoint_every_batches``). Every stage
replica, when barrier k has arrived on all its inputs (molt.runtime.ports aligns them), has
processed exactly what was sent before it; it saves its state into
``RUN_DIR/checkpoints/barrier_{k}/`` (``Stage.save_checkpoint``) and forwards the
barrier. So the folder is one consistent cut of the pipeline: what a stage has not
seen yet is re-produced upstream after a resume (the source's cursor restarts right
after the barrier), nothing is skipped or done twice.

Files: each stage replica writes ``{stage}.{replica}.json`` *last*, after any bulky
files of its own (the train stage's model and optimizer), each written under a
temporary name and renamed. A checkpoint is **complete** when every stage replica
of the pipeline has its JSON there; an incomplete one (a crash mid-way) is never
resumed from. The JSON holds ``{"state": state_dict(), "recorded": {edge: batches}}``;
``recorded`` counts the batches this replica had recorded on each recorded edge, so a
resumed run cuts its recordings back to the checkpoint before appending.

Example: 8 prompts, ``prompts_per_batch: 2``, ``checkpoint_every_batches: 2`` ->
``barrier_2`` and ``barrier_4``; ``molt run P.yaml --resume RUN_DIR`` restarts every
stage from ``barrier_4`` if complete, else ``barrier_2``.
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
    """``RUN_DIR/checkpoints/barrier_{step}``."""
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step}"


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` under a temporary name, then rename (complete or absent)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)


def replica_names(stages: dict[str, int]) -> set[str]:
    """``{stage}.{replica}`` of every replica of ``stages`` (id -> replicas).
    Example: {"a": 2, "b": 1} -> {a.0, a.1, b.0}."""
    return {f"{sid}.{r}" for sid, replicas in stages.items() for r in range(replicas)}


def complete_checkpoints(run_dir: Path, names: set[str]) -> list[Path]:
    """Complete checkpoint folders of a run, oldest first (by barrier step)."""
    root = Path(run_dir) / "checkpoints"
    found = [p for p in root.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()] if root.is_dir() else []
    done = [p for p in found if all((p / f"{n}.json").is_file() for n in names)]
    return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))


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


def prune_checkpoints(run_dir: Path, names: set[str], keep: int | None, spare: Sequence[Path] = ()) -> list[Path]:
    """Delete complete checkpoints older than the newest ``keep`` (None keeps all) but those in ``spare``,
    and incomplete ones older than the newest complete one; returns what was deleted."""
    done = complete_checkpoints(run_dir, names)
    if keep is None or not done:
        return []
    newest = int(done[-1].name[len(PREFIX):])
    stale = [p for p in done[:-keep] if p not in spare] if len(done) > keep else []
    root = Path(run_dir) / "checkpoints"
    stale += [p for p in root.glob(f"{PREFIX}*") if p.name[len(PREFIX):].isdigit()
              and int(p.name[len(PREFIX):]) < newest and p not in done]
    for p in stale:
        shutil.rmtree(p, ignore_errors=True)
    return stale


def read_replica_state(folder: Path, name: str) -> dict[str, Any]:
    """The JSON a replica saved in checkpoint ``folder`` (``{"state", "recorded"}``).

    Raises:
        ValueError: the file is missing (the checkpoint is not this pipeline's).
    """
    path = Path(folder) / f"{name}.json"
    if not path.is_file():
        raise ValueError(f"checkpoint {str(folder)!r} has no state for {name!r}; hint: resume with the "
                         "same stages and replicas as the run that saved it")
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def trainer_checkpoints(run_dir: Path, names: set[str]) -> dict[int, tuple[Path, str]]:
    """Each trainer version (optimizer steps) in the complete checkpoints of ``run_dir`` -> the oldest
    folder holding it and the trainer's stage id (the stage whose state holds ``version``)."""
    found: dict[int, tuple[Path, str]] = {}
    for folder in complete_checkpoints(run_dir, names):
        for name in sorted(names):
            state = read_replica_state(folder, name)["state"]
            if "version" in state:
                found.setdefault(state["version"], (folder, name.rsplit(".", 1)[0]))
    return found


def resumed_version(run_dir: Path) -> int | None:
    """The trainer version of the checkpoint a resumed run restarts from (``RUN_DIR/resume.json``, as
    the runner writes it); None for a run that was not resumed or a checkpoint without a trainer."""
    plan = Path(run_dir) / "resume.json"
    if not plan.is_file():
        return None
    folder = Path(json.loads(plan.read_text())["checkpoint"])
    states = [read_replica_state(folder, f.stem)["state"] for f in folder.glob("*.json")]
    return max((s["version"] for s in states if "version" in s), default=None)


def checkpoint_at_version(run_dir: Path, names: set[str], version: int) -> tuple[Path, str]:
    """The oldest complete checkpoint whose trainer was at ``version``, and the trainer's stage id.

    Raises:
        ValueError: no complete checkpoint has that version, listing those there are.
    """
    found = trainer_checkpoints(run_dir, names)
    if version not in found:
        raise ValueError(f"{run_dir}: no complete checkpoint at step {version}; got checkpoints at steps "
                         f"{sorted(found)}; hint: keep them with keep_checkpoints: null and a source's "
                         "checkpoint_every_batches")
    return found[version]
