"""Saving and restoring the trainer's part of a pipeline checkpoint (molt.runtime.checkpoint).

For a train stage with id ``train``: ``train/`` is a model folder an engine loads (config and
tokenizer files, model.safetensors), with ``optimizer.pt`` (AdamW state by parameter name),
``adapter/`` (a LoRA run's, in peft's format) and ``rng.rank{r}.pt``; the stage writes
``train.0.json`` ({"state": {"version": k}}) last. State dicts are full, so a run may resume at
another world size. Files are written under a temporary name and renamed, then ranks meet at a
barrier.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any, cast

import torch
import torch.distributed as dist
from safetensors.torch import save_file

from molt.train.lora import load_adapter, save_adapter
from molt.train.model import PolicyModel, checkpoint_state, full_state_dict


def save_train_state(folder: Path, model: PolicyModel, optimizer: torch.optim.Optimizer,
                     model_dir: Path) -> None:
    """Write model, optimizer and RNG state into ``folder`` (a collective), with the files of
    ``model_dir``, the folder the policy was loaded from."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full, optim_state = get_state_dict(model, optimizer, options=options)
    model_state = cast(dict[str, torch.Tensor], full)
    rank = dist.get_rank()
    folder.mkdir(parents=True, exist_ok=True)
    rng = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        rng["cuda"] = torch.cuda.get_rng_state()
    torch.save(rng, folder / f".rng.rank{rank}.tmp")
    os.replace(folder / f".rng.rank{rank}.tmp", folder / f"rng.rank{rank}.pt")
    if rank == 0:
        _copy_model_files(model_dir, folder)
        save_file(checkpoint_state(model, model_state), str(folder / ".model.tmp"),
                  metadata={"format": "pt"})
        os.replace(folder / ".model.tmp", folder / "model.safetensors")
        if model.lora:
            shutil.rmtree(folder / ".adapter.tmp", ignore_errors=True)
            save_adapter(folder / ".adapter.tmp", model_state, model, model.lora, str(model_dir))
            shutil.rmtree(folder / "adapter", ignore_errors=True)
            os.replace(folder / ".adapter.tmp", folder / "adapter")
        torch.save(optim_state, folder / ".optimizer.tmp")
        os.replace(folder / ".optimizer.tmp", folder / "optimizer.pt")
    dist.barrier()


def _copy_model_files(model_dir: Path, dest: Path) -> None:
    """Copy every file of the model folder but its weights."""
    for f in Path(model_dir).iterdir():
        if f.is_file() and not f.name.endswith((".safetensors", ".safetensors.index.json")):
            shutil.copy(f, dest / f.name)


def export_model_folder(model: PolicyModel, model_dir: Path, out: Path) -> Path:
    """Write the policy as a new HF folder ``out``, replacing any (a collective); returns it."""
    state = full_state_dict(model)  # every rank joins; rank 0 gets the tensors
    if dist.get_rank() == 0:
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        _copy_model_files(model_dir, tmp)
        save_file(state, str(tmp / "model.safetensors"), metadata={"format": "pt"})
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    dist.barrier()
    return out


def load_train_state(folder: Path, model: PolicyModel, optimizer: torch.optim.Optimizer,
                     model_dir: Path) -> None:
    """Restore what `save_train_state` wrote (a collective). A LoRA model restores only what
    trains: its frozen base is ``model_dir``.

    Raises:
        ValueError: a file is missing, or the weights' names or shapes differ from the model's.
    """
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    rank = dist.get_rank()
    for name in ("model.safetensors", "optimizer.pt"):
        if not (folder / name).is_file():
            raise ValueError(f"checkpoint {folder}: no {name}; hint: the checkpoint is "
                             "incomplete, resume from another one")
    model_state: dict[str, Any] = {}
    optim_state: dict[str, Any] = {}
    if rank == 0:
        if model.lora:
            model_state = load_adapter(folder / "adapter", model, model.lora, model_dir)
        else:
            model_state = _model_state(folder, model)
        optim_state = torch.load(folder / "optimizer.pt", weights_only=True)
    # Two calls, not set_state_dict: given an empty model dict (ranks > 0) it would skip the
    # model's broadcast that rank 0 joins.
    def options(strict: bool) -> StateDictOptions:
        return StateDictOptions(full_state_dict=True, broadcast_from_rank0=True, strict=strict)

    set_model_state_dict(model, model_state, options=options(not model.lora))
    # not strict: a parameter that never had a gradient has no state
    set_optimizer_state_dict(model, optimizer, optim_state, options=options(False))
    rng_path = folder / f"rng.rank{rank}.pt"
    if rng_path.is_file():  # absent when resuming on more ranks than saved
        rng = torch.load(rng_path, weights_only=True)
        torch.set_rng_state(rng["cpu"])
        if "cuda" in rng and torch.cuda.is_available():
            torch.cuda.set_rng_state(rng["cuda"])


def _model_state(folder: Path, model: PolicyModel) -> dict[str, torch.Tensor]:
    """The checkpoint's weights under the wrapper's names, converted back by transformers.

    Raises:
        ValueError: the folder's tensors are not the model's, naming some.
    """
    lm, info = type(model.lm).from_pretrained(  # type: ignore[attr-defined]
        str(folder), dtype=torch.float32, output_loading_info=True)
    wrong = sorted({*info["missing_keys"], *info["unexpected_keys"],
                    *(str(m[0]) for m in info["mismatched_keys"])})
    if wrong:
        raise ValueError(f"checkpoint {folder / 'model.safetensors'}: tensor names or shapes "
                         f"differ from the model's, e.g. {wrong[:3]}; hint: resume with the model "
                         "the run was started with")
    return {f"lm.{name}": tensor for name, tensor in lm.state_dict().items()}
