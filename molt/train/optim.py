"""AdamW with a warmup-then-decay learning-rate schedule, configured from YAML.

    lr(k) = lr * (k + 1) / warmup_steps                          for k < warmup_steps
    lr(k) = lr * (m + (1 - m) * f(p)),  p = (k - w) / (total - w) otherwise, clamped to [0, 1]

with m = ``min_lr_ratio`` and f = 1 (constant), 1 - p (linear) or (1 + cos(pi p)) / 2
(cosine). Example: lr 1e-6, warmup 2, total 6, linear, m 0: steps 0..5 use
[5e-7, 1e-6, 1e-6, 7.5e-7, 5e-7, 2.5e-7].

    optim: {lr: 1.0e-6, weight_decay: 0.0, grad_clip: 1.0, warmup_steps: 10,
            decay: cosine, total_steps: 500, min_lr_ratio: 0.1}

``lr_scale`` gives the parameters under some modules their own peak lr, a multiple of
``lr`` on the same schedule (one AdamW param group each), as LLaVA recipes give the
projector and the vision tower learning rates of their own (LLaVA-OneVision, Li et al. 2024:
``mm_projector_lr``, ``mm_vision_tower_lr``). A key matches a run of dotted components of
a parameter's name, or any of several separated by ``|`` (one key for architectures that
name a module differently): with ``lr: 4.0e-5, lr_scale: {vision_tower|visual: 0.1}``,
``model.vision_tower.encoder.layers.0.mlp.fc1.weight`` (LLaVA) or
``model.visual.blocks.0.mlp.linear_fc1.weight`` (Qwen-VL) learns at 4e-6 and every other
parameter at 4e-5.
"""

from __future__ import annotations

import math
from typing import Annotated, Literal

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
    lr_scale: dict[Annotated[str, Field(min_length=1)], Annotated[float, Field(gt=0)]] = Field(
        default_factory=dict, description="lr multiplier of the parameters under a module (a run of dotted "
        "components of their names, alternatives split by |, e.g. vision_tower|visual); the first matching key "
        "counts, the rest scale 1")


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
        ValueError: a bad schedule, or an ``lr_scale`` key under which no trainable
            parameter lies (named ``{where}.lr_scale.KEY``).
    """
    lr_factor(cfg.warmup_steps, cfg)  # fail at setup, not mid-run, on a bad schedule
    groups: dict[str, list[torch.nn.Parameter]] = {key: [] for key in [*cfg.lr_scale, ""]}
    for name, param in model.named_parameters():
        if param.requires_grad:
            groups[next((k for k in cfg.lr_scale if any(f".{run}." in f".{name}." for run in k.split("|"))),
                        "")].append(param)
    for key, params in groups.items():
        if key and not params:
            example = next((name for name, _ in model.named_parameters()), "")
            raise ValueError(f"{where}.lr_scale.{key}: no trainable parameter lies under a module of that name; "
                             f"hint: use a run of dotted components of a parameter name such as {example!r}")
    optimizer = torch.optim.AdamW([{"params": params, "lr_scale": cfg.lr_scale.get(key, 1.0)}
                                   for key, params in groups.items() if params],
                                  lr=cfg.lr, betas=cfg.betas, eps=cfg.eps, weight_decay=cfg.weight_decay)
    set_lr(optimizer, 0, cfg)
    return optimizer


def set_lr(optimizer: torch.optim.Optimizer, step: int, cfg: OptimConfig) -> float:
    """Set every group's lr for optimizer step ``step`` (times its ``lr_scale``); returns
    the unscaled one."""
    lr = cfg.lr * lr_factor(step, cfg)
    for group in optimizer.param_groups:
        group["lr"] = lr * group.get("lr_scale", 1.0)
    return lr
