"""``molt export RUN_DIR [--version V] OUT``: a run's trained policy as a Hugging Face folder.

The trainer's part of a complete checkpoint is already a model folder (molt.train.state: config,
tokenizer, chat template and ``model.safetensors`` under the names engines load); the export copies it
without the optimizer and RNG state, so ``transformers``' ``from_pretrained`` and ``vllm.LLM`` load OUT
as they load the model the run started from. A LoRA run's weights there are merged; ``OUT/adapter/`` is
its adapter alone in peft's format (molt.train.lora: ``PeftModel.from_pretrained(base, OUT/adapter)``).
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

TRAINING_STATE = ("optimizer.pt", "rng.rank*.pt")  # in a checkpoint's trainer folder; not part of a model
PROVENANCE = "molt-model.json"  # how the first model was made (molt.models): molt_export.json's made_from


def export_run(run_dir: Path, version: int | None, out: Path) -> tuple[Path, int]:
    """Write the trainer's weights of ``run_dir``'s complete checkpoint at ``version`` (default: the newest)
    as the Hugging Face folder ``out`` (into a temporary sibling, then renamed), with ``molt_export.json``
    naming the run, version, checkpoint, the model the run started from and how that one's base was made.

    Returns:
        (``out``, the policy version exported).

    Raises:
        ValueError: ``run_dir`` is no run directory, it has no complete checkpoint at ``version``
            (listing those there are), or ``out`` exists.
    """
    from molt.commands.eval import resolve_target

    if not (run_dir / "pipeline.yaml").is_file():
        raise ValueError(f"molt export: {str(run_dir)!r} is not a run directory (no pipeline.yaml)")
    if out.exists():
        raise ValueError(f"molt export: {str(out)!r} exists; hint: name a new folder")
    folder, exported, pipe = resolve_target(str(run_dir), version)
    assert exported is not None and pipe is not None  # a run directory's
    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        shutil.copytree(folder, tmp, ignore=shutil.ignore_patterns(*TRAINING_STATE, PROVENANCE),
                        copy_function=shutil.copyfile)  # files readable as the umask allows, not the checkpoint's 0600
        made = json.loads((folder / PROVENANCE).read_text()) if (folder / PROVENANCE).is_file() else None
        (tmp / "molt_export.json").write_text(json.dumps({
            "run_dir": str(run_dir.resolve()), "checkpoint": str(folder), "policy_version": exported,
            "started_from": getattr(pipe.stages[folder.name].config, "model", None), "made_from": made}))
        tmp.rename(out)
    except BaseException:  # a full disk, an interrupt: nothing half-written is left
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out, exported
