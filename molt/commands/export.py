"""``molt export``: a run's trained policy as a Hugging Face folder.

A checkpoint's trainer folder is a model folder (molt.train.state); the export copies it without
the training state. A LoRA run's weights there are merged; ``OUT/adapter/`` is its adapter.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import click

TRAINING_STATE = ("optimizer.pt", "rng.rank*.pt")  # in a checkpoint's trainer folder
PROVENANCE = "molt-model.json"  # how the first model was made: molt_export.json's made_from


@click.command("export")
@click.argument("run_dir", type=click.Path())
@click.argument("out", type=click.Path())
@click.option("--version", type=int,
              help="a policy version (a complete checkpoint; default: the newest)")
def command(run_dir: str, out: str, version: int | None) -> int:
    """Write a run's trained policy as a Hugging Face folder."""
    path, exported = export_run(Path(run_dir), version, Path(out))
    click.echo(f"{path} (policy version {exported} of {run_dir})")
    return 0


def export_run(run_dir: Path, version: int | None, out: Path) -> tuple[Path, int]:
    """Copy the trainer's folder of ``run_dir``'s checkpoint at ``version`` (default: the
    newest) to the new folder ``out`` with ``molt_export.json``; returns (out, version).

    Raises:
        ValueError: not a run directory, no complete checkpoint at ``version``, or ``out`` exists.
    """
    from molt.commands.eval import resolve_target

    if not (run_dir / "pipeline.yaml").is_file():
        raise ValueError(f"molt export: {str(run_dir)!r} is not a run directory (no pipeline.yaml)")
    if out.exists():
        raise ValueError(f"molt export: {str(out)!r} exists; hint: name a new folder")
    folder, exported, pipe = resolve_target(str(run_dir), version)
    assert exported is not None and pipe is not None  # a run directory's
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:  # copyfile: files readable as the umask allows, not the checkpoint's 0600
        shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns(*TRAINING_STATE, PROVENANCE),
                        copy_function=shutil.copyfile)
        made = folder / PROVENANCE
        (tmp / "molt_export.json").write_text(json.dumps({
            "run_dir": str(run_dir.resolve()), "checkpoint": str(folder),
            "policy_version": exported,
            "started_from": getattr(pipe.stages[folder.name].config, "model", None),
            "made_from": json.loads(made.read_text()) if made.is_file() else None}))
        tmp.rename(out)
    except BaseException:  # a full disk, an interrupt: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, exported
