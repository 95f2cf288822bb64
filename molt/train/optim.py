"""AdamW with a warmup-then-decay learning-rate schedule, configured from YAML.

    lr(k) = lr * (k + 1) / warmup_steps                          for k < warmup_steps
    lr(k) = lr * (m + (1 - m) * f(p)),  p = (k - w) / max(total - w, 1) otherwise, clamped to [0, 1]

with w = ``warmup_steps``, total = ``total_steps``, m = ``min_lr_ratio`` and f = 1
(constant), 1 - p (linear) or (1 + cos(pi p)) / 2 (cosine). Example: lr 1e-6, warmup 2,
total 6, linear, m 0: steps 0..5 use [5e-7, 1e-6, 1e-6, 7.5e-7, 5e-7, 2.5e-7].

    optim: {lr: 1.0e-6, weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 10,
            decay: cosine, total_steps: 500, min_lr_ratio: 0.1}

``lr_scale`` gives some parameters their own peak lr, a multiple (> 0) of ``lr`` on the
same schedule (one AdamW param group per key), as LLaVA recipes give the projector and the
vision tower learning rates of their own (LLaVA-OneVision, Li et al. 2024:
``mm_projector_lr``, ``mm_vision_tower_lr``). A key matches a parameter when it equals a
contiguous run of the dot-separated components of its name, anywhere in it; ``a|b`` matches
where either does (one key for architectures that name a module differently; it fails only
when neither matches). The first matching key, in YAML order, takes a parameter. With
``lr: 4.0e-5, lr_scale: {vision_tower|visual: 0.1}``,
``model.vision_tower.encoder.layers.0.mlp.fc1.weight`` (LLaVA's tower; its projector is
``multi_modal_projector``) and ``model.visual.blocks.0.mlp.linear_fc1.weight`` (Qwen-VL's
``visual``, which holds its projector, ``merger``, too) learn at 4e-6, the rest at 4e-5.
The configured scales apply on resume too (a checkpoint's own are not kept). A key whose
parameters are all frozen (a vision tower under ``policy.lora``) is ignored, with a warning.
"""

from __future__ import annotations

import difflib
import logging
import math
from typing import Annotated, Literal

import torch
from pydantic import BaseModel, ConfigDict, Field

log = logging.getLogger(__name__)


class OptimConfig(BaseModel):
    """AdamW and schedule knobs (see the module docstring)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    lr: float = Field(1e-6, gt=0, description="peak learning rate")
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = Field(1e-8, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad L2 norm; None = no clipping")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    decay: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = Field(None, ge=1, description="steps to decay over; needed by linear/cosine")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of lr")
    lr_scale: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="lr multiplier of the parameters a key matches (a run of dotted "
        "components of their names, alternatives split by |, e.g. vision_tower|visual; module docstring); the "
        "first matching key counts, the rest scale 1")


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (from 0); module docstring example.

    Raises:
        ValueError: linear or cosine decay without ``optim.total_steps``.
    """
    if step < cfg.warmup_steps:
        return (step + 1) / cfg.warmup_steps
    if cfg.decay == "constant":
        return 1.0
    if cfg.total_steps is None:
        raise ValueError(f"optim.decay {cfg.decay!r} needs optim.total_steps; got None; "
                         "hint: set total_steps or use decay: constant")
    span = max(cfg.total_steps - cfg.warmup_steps, 1)
    progress = min(max((step - cfg.warmup_steps) / span, 0.0), 1.0)
    shape = 1.0 - progress if cfg.decay == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return cfg.min_lr_ratio + (1.0 - cfg.min_lr_ratio) * shape


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig, where: str = "optim") -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (FSDP2 shards are fine: updates are
    elementwise): one param group per ``lr_scale`` key, one for the rest, lrs set for step 0.

    Raises:
        ValueError: a bad schedule, or an ``lr_scale`` key that takes no parameter (none
            matches, or an earlier key took them), named ``{where}.lr_scale.KEY`` with the
            closest name components.
    """
    lr_factor(cfg.warmup_steps, cfg)  # fail at setup, not mid-run, on a bad schedule
    groups: dict[str, list[torch.nn.Parameter]] = {key: [] for key in [*cfg.lr_scale, ""]}
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    for name, param in model.named_parameters():
        matches = (k for k in cfg.lr_scale if any(f".{run.strip()}." in f".{name}." for run in k.split("|")))
        groups[next(matches, "")].append(param)
    for key, params in groups.items():
        if key and params and not any(p.requires_grad for p in params):
            log.warning("%s.lr_scale.%s: every parameter it takes is frozen (%d tensors, e.g. by policy.lora): "
                        "ignored", where, key, len(params))
        groups[key] = [p for p in params if p.requires_grad]
        if key and not params:
            close = difflib.get_close_matches(key, sorted({part for n, _ in trainable for part in n.split(".")}))
            raise ValueError(f"{where}.lr_scale.{key}: takes no trainable parameter (none matches, or an earlier "
                             f"key took them); hint: a run of dotted components of a parameter name, e.g. "
                             f"{close or [n for n, _ in trainable[:1]]}")
    optimizer = torch.optim.AdamW([{"params": params, "lr_scale_key": key} for key, params in groups.items() if params],
                                  lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    set_lr(optimizer, 0, cfg)
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: OptimConfig) -> float:
    """Set every group's lr for optimizer step ``step``, times its ``cfg.lr_scale``; returns
    the unscaled lr (the one the trainer logs as ``lr``)."""
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * cfg.lr_scale.get(group.get("lr_scale_key", ""), 1.0)
    return lr
