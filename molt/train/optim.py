"""AdamW with a warmup-then-decay learning-rate schedule, configured from YAML.

    lr(k) = lr * (k + 1) / warmup_steps                          for k < warmup_steps
    lr(k) = lr * (m + (1 - m) * f(p)),  p = (k - w) / (total - w) otherwise, clamped to [0, 1]

with m = ``min_lr_ratio`` and f = 1 (constant), 1 - p (linear) or (1 + cos(pi p)) / 2
(cosine). Example: lr 1e-6, warmup 2, total 6, linear, m 0: steps 0..5 use
[5e-7, 1e-6, 1e-6, 7.5e-7, 5e-7, 2.5e-7].

    optim: {lr: 1.0e-6, weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 10,
            decay: cosine, total_steps: 500, min_lr_ratio: 0.1}
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field


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


def make_optimizer(params: list[torch.nn.Parameter], cfg: OptimConfig) -> torch.optim.AdamW:
    """AdamW over ``params`` (FSDP2 shards are fine: updates are elementwise)."""
    lr_factor(cfg.warmup_steps, cfg)  # fail at setup, not mid-run, on a bad schedule
    return torch.optim.AdamW(params, lr=cfg.lr * lr_factor(0, cfg), betas=cfg.betas, eps=cfg.eps,
                             weight_decay=cfg.weight_decay)


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: OptimConfig) -> float:
    """Set every group's lr for optimizer step ``step``; returns it."""
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr
    return lr
