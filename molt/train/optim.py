"""AdamW with a warmup-then-decay learning-rate schedule.

    lr(k) = lr * (k + 1) / w                                     for k < w
    lr(k) = lr * (m + (1 - m) * f(p)),  p = clamp((k - w) / max(total - w, 1), 0, 1) otherwise

with w = ``warmup_steps``, total = ``total_steps``, m = ``min_lr_ratio`` and f = 1 (constant),
1 - p (linear) or (1 + cos(pi p)) / 2 (cosine). Example: lr 1e-6, warmup 2, total 6, linear,
m 0: steps 0..5 use [5e-7, 1e-6, 1e-6, 7.5e-7, 5e-7, 2.5e-7].

``lr_scale`` multiplies the lr of the parameters a key matches: a run of dot-separated name
components, ``a|b`` either; the first matching key takes a parameter. With ``lr_scale:
{vision_tower|visual: 0.1}``, ``model.visual.blocks.0.mlp.fc1.weight`` learns at lr / 10.
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
    grad_clip: float | None = Field(1.0, gt=0, description="max global grad L2 norm; None = off")
    warmup_steps: int = Field(0, ge=0, description="optimizer steps of linear warmup")
    decay: Literal["constant", "linear", "cosine"] = "constant"
    total_steps: int | None = Field(None, ge=1, description="steps to decay over (linear/cosine)")
    min_lr_ratio: float = Field(0.0, ge=0, le=1, description="final lr as a fraction of lr")
    lr_scale: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="lr multiplier of the parameters a key matches (a run of "
        "dotted name components, alternatives split by |); the first matching key counts")


def lr_factor(step: int, cfg: OptimConfig) -> float:
    """Multiplier of ``cfg.lr`` at optimizer step ``step`` (from 0).

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


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig,
                   where: str = "optim") -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters, one param group per ``lr_scale`` key.

    Raises:
        ValueError: a bad schedule, or an ``lr_scale`` key that takes no parameter.
    """
    lr_factor(cfg.warmup_steps, cfg)  # fail at setup, not mid-run, on a bad schedule
    groups: dict[str, list[torch.nn.Parameter]] = {key: [] for key in [*cfg.lr_scale, ""]}
    trainable = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    for name, param in model.named_parameters():
        matches = (k for k in cfg.lr_scale
                   if any(f".{run.strip()}." in f".{name}." for run in k.split("|")))
        groups[next(matches, "")].append(param)
    for key, params in groups.items():
        if key and params and not any(p.requires_grad for p in params):
            log.warning("%s.lr_scale.%s: every parameter it takes is frozen (%d tensors, e.g. by "
                        "policy.lora): ignored", where, key, len(params))
        groups[key] = [p for p in params if p.requires_grad]
        if key and not params:
            parts = sorted({part for n, _ in trainable for part in n.split(".")})
            close = difflib.get_close_matches(key, parts)
            raise ValueError(f"{where}.lr_scale.{key}: takes no trainable parameter (none matches, "
                             f"or an earlier key took them); hint: a run of dotted components of a "
                             f"parameter name, e.g. {close or [n for n, _ in trainable[:1]]}")
    param_groups = [{"params": params, "lr_scale_key": key}
                    for key, params in groups.items() if params]
    optimizer = torch.optim.AdamW(param_groups, lr=cfg.lr, betas=cfg.betas, eps=cfg.eps,
                                  weight_decay=cfg.weight_decay)
    set_lr(optimizer, 0, cfg)
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: OptimConfig) -> float:
    """Set every group's lr for optimizer step ``step``, times its ``lr_scale``; returns the
    unscaled lr."""
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * cfg.lr_scale.get(group.get("lr_scale_key", ""), 1.0)
    return lr
