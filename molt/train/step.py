"""One optimizer step of the policy over a packed step batch (DESIGN §8).

Each rank trains its rows (column ``dp_rank``) of the whole batch; B rows, T longest row:

    1) refuse stale tokens: version - policy_version_t <= max_staleness on generated tokens
    2) for each of the rank's M micro-batches (same M on every rank), less `inert_rows`:
         logp  = packed forward [B, T]  (MoE routing_replay: the engine's experts, R3)
         old   = rollout_logprobs (anchor "rollout") or logp.detach() (anchor "trainer")
         c     = correction(logp, rollout_logprobs)
         L     = c.weight * policy_loss(logp, old, A, mask=c.keep) [+ kl.coef * KL(logp, ref)]
         share = aggregation(L, loss_mask, step_loss_tokens, step_loss_seqs)
                 [+ router_aux_loss_coef * aux * loss tokens / step_loss_tokens]
         backward(share * world_size)
    3) clip the global grad norm, set the scheduled lr, AdamW step

The update is the same for any split into ranks and micro-batches.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
import torch.distributed as dist
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

from molt.algorithms import apply_correction, merge_token_metrics, policy_step_metrics
from molt.algorithms.corrections import Correction
from molt.algorithms.loss_configs import (AggregationConfig, CorrectionConfig, KLConfig,
                                          NoCorrectionConfig, PolicyLossConfig, PPOLossConfig,
                                          TokenMeanConfig)
from molt.algorithms.losses import PolicyLoss
from molt.columns import padded
from molt.runtime.memory import release_freed_memory
from molt.schema import make_schema
from molt.train.model import PolicyModel
from molt.train.moe import load_metrics
from molt.train.optim import OptimConfig, set_lr

STEP_READS = ("sample_id", "token_ids", "loss_mask", "rollout_logprobs", "policy_version",
              "advantages")
SFT_UNREAD = ("rollout_logprobs", "advantages")  # SFT records (demonstrations) have neither


class ObjectiveConfig(BaseModel):
    """Loss knobs of the train stage (kl needs column ref_logprobs)."""

    model_config = ConfigDict(extra="forbid")

    policy_loss: PolicyLossConfig = Field(default_factory=PPOLossConfig)  # type: ignore[arg-type, assignment]
    correction: CorrectionConfig = Field(default_factory=NoCorrectionConfig)  # type: ignore[arg-type, assignment]
    kl: KLConfig | None = None
    aggregation: AggregationConfig = Field(default_factory=TokenMeanConfig)  # type: ignore[arg-type, assignment]
    anchor: Literal["rollout", "trainer"] = Field(
        "rollout", description="old logprobs of the ratio: the engine's, or the trainer's own")
    router_aux_loss_coef: float = Field(
        0.0, ge=0, description="MoE: weight of the Switch load-balancing loss; 0 = off")
    routing_replay: bool = Field(
        False, description="MoE: route each token to the engine's experts (R3, routed_experts)")
    routing_replay_compare: bool = Field(
        False, description="MoE: one more no-grad forward per micro-batch with replay the other "
        "way, to log moe/logprob_diff_replay and moe/logprob_diff_no_replay (nats)")


@dataclass
class StepResult:
    """What one step did, reduced over ranks."""

    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    metrics: dict[str, float]


def check_objective(obj: ObjectiveConfig, where: str) -> None:
    """Refuse objectives the train stage cannot honour.

    Raises:
        ValueError: a KL term outside the loss, or SFT with an off-policy correction.
    """
    if obj.policy_loss.type == "sft" and obj.correction.type != "none":
        raise ValueError(f"{where}.correction: SFT has no rollout logprobs to correct; got "
                         f"{obj.correction.type!r}; hint: leave correction unset")
    if obj.kl is not None and obj.kl.apply_to != "loss":
        raise ValueError(f"{where}.kl.apply_to: the train stage applies a KL term to the loss "
                         f"only; got {obj.kl.apply_to!r}; hint: fold KL into the reward before the "
                         "advantage stage")


def check_staleness(batch: pa.RecordBatch, version: int, max_staleness: int | None) -> int:
    """Refuse generated tokens older than ``max_staleness`` steps; return the step's max lag.

    Raises:
        ValueError: naming the first violating ``sample_id``.
    """
    worst = 0
    rows = zip(batch.column("sample_id").to_pylist(), batch.column("policy_version").to_pylist(),
               batch.column("loss_mask").to_pylist())
    for sample_id, versions, mask in rows:
        generated = [v for v, m in zip(versions, mask) if m]
        lag = version - min(generated) if generated else 0
        if max_staleness is not None and lag > max_staleness:
            raise ValueError(f"sample {sample_id!r} has a token of policy_version "
                             f"{min(generated)}, {lag} steps behind the trainer's version "
                             f"{version}; max_staleness is {max_staleness}; hint: the rollout's "
                             "max_staleness and groups_per_step must match the train and pack "
                             "stages'")
        worst = max(worst, lag)
    return worst


def lag_sum(batch: pa.RecordBatch, version: int) -> tuple[float, int]:
    """(sum of ``version - policy_version`` over generated tokens, their count)."""
    versions = pc.list_flatten(batch.column("policy_version")).to_numpy(zero_copy_only=False)
    mask = pc.list_flatten(batch.column("loss_mask")).to_numpy(zero_copy_only=False).astype(bool)
    return float((version - versions[mask]).sum()), int(mask.sum())


def _micro_loss(model: PolicyModel, mb: pa.RecordBatch, obj: ObjectiveConfig,
                step_tokens: int, step_seqs: int) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss (0-dim), and its metrics."""
    mask = padded(mb, "loss_mask", torch.bool)  # [B, T]
    fwd = model.rows_forward(mb, mask, obj.routing_replay, obj.routing_replay_compare)
    mask = mask.to(fwd.logp.device)
    share, metrics = policy_loss(fwd.logp, mb, mask, obj, step_tokens, step_seqs, fwd.entropy)
    if fwd.aux is not None:  # MoE: weighted by this micro-batch's share of the loss tokens
        metrics["moe/aux_loss"] = float(fwd.aux.detach())
        if obj.router_aux_loss_coef:
            share = share + obj.router_aux_loss_coef * fwd.aux * (mask.sum() / step_tokens)
    if fwd.other is not None:  # |train - rollout| logprob with routing replay and without
        rollout = padded(mb, "rollout_logprobs", torch.float32).to(mask.device)
        gaps = {obj.routing_replay: fwd.logp.detach(), not obj.routing_replay: fwd.other}
        for replayed, name in ((True, "replay"), (False, "no_replay")):
            gap = ((gaps[replayed] - rollout).abs() * mask).sum()
            metrics[f"moe/logprob_diff_{name}"] = float(gap / mask.sum().clamp_min(1))
    return share, metrics


def _corrected_loss(obj: ObjectiveConfig, logp: Tensor, rollout: Tensor, adv: Tensor,
                    mask: Tensor) -> tuple[Tensor, PolicyLoss, Correction]:
    """(c.weight * policy_loss [B, T], the policy loss, the correction) of step 2."""
    corr = obj.correction.compute(logp, rollout, mask)
    old = rollout if obj.anchor == "rollout" else logp.detach()
    pl = obj.policy_loss.compute(logp, old, adv, corr.keep)
    return apply_correction(pl.per_token_loss, corr), pl, corr


def policy_loss(logp: Tensor, mb: pa.RecordBatch, mask: Tensor, obj: ObjectiveConfig,
                step_tokens: int, step_seqs: int,
                entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The share (0-dim) and metrics of step 2 from ``logp`` [B, T]; an SFT batch's missing
    ``rollout_logprobs`` and ``advantages`` are zeros."""
    dev = logp.device
    rollout, adv = (padded(mb, name, torch.float32).to(dev) if name in mb.schema.names
                    else torch.zeros_like(logp) for name in ("rollout_logprobs", "advantages"))
    per_token, pl, corr = _corrected_loss(obj, logp, rollout, adv, mask)
    token_kl = None
    if obj.kl is not None:
        token_kl = obj.kl.per_token(logp, padded(mb, "ref_logprobs", torch.float32).to(dev), mask)
        per_token = per_token + obj.kl.coef * token_kl
    share = obj.aggregation.reduce(per_token, mask, step_tokens, step_seqs)
    return share, policy_step_metrics(mask, adv, pl, corr, logp, rollout, token_kl, entropy)


def zero_advantage_is_inert(obj: ObjectiveConfig) -> bool:
    """Whether a token with advantage 0 adds no gradient under ``obj``."""
    if obj.kl is not None:
        return False
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.5, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    per_token = _corrected_loss(obj, logp, rollout, torch.zeros(1, 3), mask)[0]
    loss = obj.aggregation.reduce(per_token, mask, 3, 1)
    (grad,) = torch.autograd.grad(loss, logp, allow_unused=True)
    return grad is None or not bool(grad.any())


def inert_rows(batch: pa.RecordBatch, obj: ObjectiveConfig) -> np.ndarray:
    """[N] bool: rows with ``advantages`` 0 on every loss token, if that adds no gradient; they
    still count in the loss denominators."""
    if batch.num_rows == 0 or not zero_advantage_is_inert(obj):
        return np.zeros(batch.num_rows, dtype=bool)
    rows = zip(batch.column("advantages").to_pylist(), batch.column("loss_mask").to_pylist())
    return np.array([not any(a != 0 and m for a, m in zip(adv, mask)) for adv, mask in rows])


def accumulate(model: PolicyModel, batch: pa.RecordBatch, obj: ObjectiveConfig,
               rank: int, world_size: int) -> tuple[float, list[dict[str, float]]]:
    """Forward/backward ``rank``'s micro-batches; returns (sum of shares, metrics)."""
    ranks = batch.column("dp_rank").to_numpy()
    micro = batch.column("micro_batch").to_numpy()
    num_micro = int(micro.max()) + 1 if batch.num_rows else 0
    step_tokens = int(batch.column("step_loss_tokens")[0].as_py())
    step_seqs = int(batch.column("step_loss_seqs")[0].as_py())
    inert = inert_rows(batch, obj)
    total, parts = 0.0, []
    for k in range(num_micro):
        set_sync = getattr(model, "set_requires_gradient_sync", None)
        if callable(set_sync):  # FSDP2: reduce-scatter once, after the last micro-batch
            set_sync(k == num_micro - 1)
        rows = ((ranks == rank) & (micro == k) & ~inert).nonzero()[0]
        if len(rows) == 0:
            share = model.dummy_forward(obj.routing_replay_compare)
        else:
            share, metrics = _micro_loss(model, batch.take(rows), obj, step_tokens, step_seqs)
            parts.append(metrics)
        (share * world_size).backward()
        total += float(share.detach())
    return total, parts


def optimizer_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                   grad_clip: float | None) -> float:
    """Clip the global grad norm, step, zero grads; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return float(full)


def reduce_metrics(parts: list[dict[str, float]], keys: list[str]) -> dict[str, float]:
    """Merge metrics over micro-batches, then ranks, by each key's reduction; a rank without
    tokens adds nothing."""
    local = merge_token_metrics(parts) if parts else {}
    count = local.get("tokens/count", 0.0)
    values = []
    for key in keys:
        v = local.get(key, 0.0)
        if key.endswith("max"):
            values.append(v if count else -math.inf)
        elif key.endswith("min"):
            values.append(-v if count else -math.inf)
        else:
            values.append(v if key.endswith(("count", "sum")) else v * count)
    tensor = torch.tensor(values, dtype=torch.float64)
    is_max = torch.tensor([k.endswith(("max", "min")) for k in keys])
    summed, maxed = tensor.where(~is_max, 0.0), tensor.where(is_max, -math.inf)
    if dist.is_initialized() and dist.get_world_size() > 1:
        dist.all_reduce(summed)
        dist.all_reduce(maxed, op=dist.ReduceOp.MAX)
    total = float(summed[keys.index("tokens/count")]) if "tokens/count" in keys else 0.0
    out = {}
    for i, key in enumerate(keys):
        if key.endswith(("max", "min")):
            v = float(maxed[i]) if math.isfinite(float(maxed[i])) else 0.0
            out[key] = -v if key.endswith("min") else v
        else:
            mean = not key.endswith(("count", "sum"))
            out[key] = float(summed[i]) / max(total, 1.0) if mean else float(summed[i])
    return out


def metric_keys(obj: ObjectiveConfig) -> list[str]:
    """The metric keys a micro-batch yields under ``obj``."""
    zeros, mask = torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.bool)
    corr = obj.correction.compute(zeros, zeros, mask)
    pl = obj.policy_loss.compute(zeros, zeros, zeros, mask)
    kl = zeros if obj.kl else None
    return sorted(policy_step_metrics(mask, zeros, pl, corr, zeros, zeros, kl, zeros))


def train_step(model: PolicyModel, optimizer: torch.optim.Optimizer, batch: pa.RecordBatch,
               obj: ObjectiveConfig, optim_cfg: OptimConfig, version: int) -> StepResult:
    """Steps 2-3 on this rank's rows; ``version``: optimizer steps already taken."""
    rank = dist.get_rank() if dist.is_initialized() else 0
    world_size = dist.get_world_size() if dist.is_initialized() else 1
    lr = set_lr(optimizer, version, optim_cfg)
    hooks = model.router_hooks
    if hooks is not None:
        hooks.take_counts()  # drop what forwards outside a step counted
    local_loss, parts = accumulate(model, batch, obj, rank, world_size)
    loss = torch.tensor([local_loss], dtype=torch.float64)
    if world_size > 1:
        dist.all_reduce(loss)
    grad_norm = optimizer_step(model, optimizer, optim_cfg.grad_clip)
    moe_keys = ["moe/aux_loss"] + (["moe/logprob_diff_no_replay", "moe/logprob_diff_replay"]
                                   if obj.routing_replay_compare else [])
    metrics = reduce_metrics(parts, metric_keys(obj) + (moe_keys if hooks is not None else []))
    if hooks is not None:
        counts = hooks.take_counts()
        if world_size > 1:
            dist.all_reduce(counts)
        metrics.update(load_metrics(counts, hooks.num_experts))
    num_tokens = sum(len(t) for t in batch.column("token_ids").to_pylist())
    # 1 = the step had no policy gradient
    metrics["rows/inert_frac"] = float(inert_rows(batch, obj).mean()) if batch.num_rows else 0.0
    return StepResult(float(loss), grad_norm, lr, num_tokens, metrics)


STEP_SCHEMA = make_schema([pa.field(name, type_, metadata={b"doc": doc.encode()})
                           for name, type_, doc in (
    ("step", pa.int32(), "optimizer step just taken, from 0"),
    ("policy_version", pa.int32(), "optimizer steps in the weights now (step + 1)"),
    ("num_rows", pa.int64(), "rows trained in the step (0: a resumed trainer's first record)"),
    ("num_tokens", pa.int64(), "tokens forwarded (prompt + completion)"),
    ("num_loss_tokens", pa.int64(), "loss_mask tokens of the step"),
    ("loss", pa.float64(), "step loss (sum of every micro-batch share)"),
    ("grad_norm", pa.float64(), "global grad L2 norm before clipping"),
    ("lr", pa.float64(), "learning rate of the step (before optim.lr_scale)"),
    ("reward_mean", pa.float64(), "mean reward of the step's rows (0 if none)"),
    ("max_lag", pa.int32(), "largest version lag of a generated token"),
    ("step_seconds", pa.float64(), "wall time of the step (s)"),
)], "train_step")
