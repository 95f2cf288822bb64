"""One optimizer step of the policy over a packed step batch (DESIGN §8).

The pack stage sends a step as one record batch whose rows carry ``dp_rank``,
``micro_batch`` and the step's global ``step_loss_tokens`` / ``step_loss_seqs``.
Every rank sees the whole batch and trains its own rows:

    1) refuse stale tokens:  version - policy_version_t <= max_staleness on every generated token
    2) for each of the rank's micro-batches (the same count M on every rank), without the
       rows whose advantages are all 0 when that adds no gradient (`inert_rows`):
         logp = packed forward (block-diagonal)          # [S] -> [B, T]; a MoE with routing_replay
                routes each token to the experts the engine chose (column routed_experts, R3)
         old  = rollout_logprobs ("rollout" anchor) or logp.detach() ("trainer" anchor:
                the proximal policy; one optimizer step per batch makes the separate
                no-grad recompute pass unnecessary, its result would be identical)
         c    = correction(logp, rollout_logprobs)       # TIS, IcePop, ... (molt.algorithms)
         L    = c.weight * policy_loss(logp, old, A, mask=c.keep) [+ kl.coef * KL(logp, ref)]
         share = aggregation(L, loss_mask, step_loss_tokens, step_loss_seqs)
                 [+ router_aux_loss_coef * aux * loss tokens / step_loss_tokens]   # MoE (molt.train.moe)
         backward(share * world_size)                     # FSDP averages over ranks; we want the sum
    3) clip the global grad norm, set the scheduled lr, AdamW step

So the update is the same for any split into ranks and micro-batches. An empty
micro-batch (the rank had fewer rows) runs a 2-token dummy forward/backward with zero
loss, so FSDP's collectives still match across ranks.

Shape legend: B rows of a micro-batch, T their longest row, S packed tokens.
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
from molt.algorithms.loss_configs import (AggregationConfig, CorrectionConfig, KLConfig, NoCorrectionConfig,
                                          PolicyLossConfig, PPOLossConfig, TokenMeanConfig)
from molt.columns import padded
from molt.runtime.memory import release_freed_memory
from molt.schema import make_schema
from molt.train.model import PolicyModel
from molt.train.moe import load_metrics
from molt.train.optim import OptimConfig, set_lr

STEP_READS = ("sample_id", "token_ids", "loss_mask", "rollout_logprobs", "policy_version", "advantages")
SFT_UNREAD = ("rollout_logprobs", "advantages")  # SFT records (demonstrations) have neither


class ObjectiveConfig(BaseModel):
    """Loss knobs of the train stage; each sub-config is selected by its ``type:``.

        policy_loss: {type: ppo, clip_low: 0.2, clip_high: 0.28}
        correction: {type: tis, cap: 2.0}
        kl: {estimator: k3, coef: 0.001, apply_to: loss}     # needs column ref_logprobs
        aggregation: {type: token_mean}
        anchor: rollout
    """

    model_config = ConfigDict(extra="forbid")

    policy_loss: PolicyLossConfig = Field(default_factory=PPOLossConfig)  # type: ignore[arg-type, assignment]
    correction: CorrectionConfig = Field(default_factory=NoCorrectionConfig)  # type: ignore[arg-type, assignment]
    kl: KLConfig | None = None
    aggregation: AggregationConfig = Field(default_factory=TokenMeanConfig)  # type: ignore[arg-type, assignment]
    anchor: Literal["rollout", "trainer"] = Field(
        "rollout", description="old logprobs of the policy ratio: the engine's, or the trainer's own")
    router_aux_loss_coef: float = Field(
        0.0, ge=0, description="MoE: weight of the Switch load-balancing loss (molt.train.moe); 0 = off")
    routing_replay: bool = Field(
        False, description="MoE: route every token the engine routed to the experts it chose (R3; column "
        "routed_experts, molt.train.moe.RouterHooks); router logits are still recomputed")
    routing_replay_compare: bool = Field(
        False, description="MoE: one more no-grad forward per micro-batch with replay the other way, to log "
        "moe/logprob_diff_replay and moe/logprob_diff_no_replay (|train - rollout| logprob, nats)")


@dataclass
class StepResult:
    """What one step did, reduced over ranks. ``metrics`` use molt.algorithms.policy_metrics keys."""

    loss: float
    grad_norm: float
    lr: float
    num_tokens: int
    metrics: dict[str, float]


def check_objective(obj: ObjectiveConfig, where: str) -> None:
    """Refuse objective settings the train stage cannot honour.

    Raises:
        ValueError: naming the key under ``where`` (e.g. ``stages.train.config.kl.apply_to``): a KL
            term outside the loss, or SFT with an off-policy correction (SFT has no rollout logprobs).
    """
    if obj.policy_loss.type == "sft" and obj.correction.type != "none":
        raise ValueError(f"{where}.correction: SFT has no rollout logprobs to correct; got "
                         f"{obj.correction.type!r}; hint: leave correction unset")
    if obj.kl is not None and obj.kl.apply_to != "loss":
        raise ValueError(f"{where}.kl.apply_to: the train stage applies a KL term to the loss only; got "
                         f"{obj.kl.apply_to!r}; hint: fold KL into the reward before the advantage stage")


def check_staleness(batch: pa.RecordBatch, version: int, max_staleness: int | None) -> int:
    """Refuse generated tokens older than ``max_staleness`` steps; return the step's max lag.

    lag_t = version - policy_version_t on tokens with loss_mask true.
    Example: version 3, max_staleness 1, a row with versions [-1, 1, 2] on mask
    [F, T, T] has lag 2 > 1 -> ValueError naming its sample_id.

    Raises:
        ValueError: naming the first violating ``sample_id``, its lag and the limit.
    """
    worst = 0
    rows = zip(batch.column("sample_id").to_pylist(), batch.column("policy_version").to_pylist(),
               batch.column("loss_mask").to_pylist())
    for sample_id, versions, mask in rows:
        generated = [v for v, m in zip(versions, mask) if m]
        lag = version - min(generated) if generated else 0
        if max_staleness is not None and lag > max_staleness:
            raise ValueError(f"sample {sample_id!r} has a token of policy_version {min(generated)}, "
                             f"{lag} steps behind the trainer's version {version}; max_staleness is "
                             f"{max_staleness}; hint: the rollout's max_staleness and groups_per_step "
                             "must match the train and pack stages'")
        worst = max(worst, lag)
    return worst


def lag_sum(batch: pa.RecordBatch, version: int) -> tuple[float, int]:
    """Sum over generated tokens (loss_mask) of ``version - policy_version``, and their count."""
    versions = pc.list_flatten(batch.column("policy_version")).to_numpy(zero_copy_only=False)
    mask = pc.list_flatten(batch.column("loss_mask")).to_numpy(zero_copy_only=False).astype(bool)
    return float((version - versions[mask]).sum()), int(mask.sum())


def _micro_loss(model: PolicyModel, mb: pa.RecordBatch, obj: ObjectiveConfig,
                step_tokens: int, step_seqs: int) -> tuple[Tensor, dict[str, float]]:
    """This micro-batch's share of the step loss (0-dim) and its token metrics: the model's forward of
    its rows (all that differs by model family: `PolicyModel.rows_forward`), then `policy_loss`."""
    mask = padded(mb, "loss_mask", torch.bool)  # [B, T]
    fwd = model.rows_forward(mb, mask, obj.routing_replay, obj.routing_replay_compare)
    mask = mask.to(fwd.logp.device)
    share, metrics = policy_loss(fwd.logp, mb, mask, obj, step_tokens, step_seqs, fwd.entropy)
    if fwd.aux is not None:  # MoE: the load-balancing loss of this forward, weighted by its loss tokens
        metrics["moe/aux_loss"] = float(fwd.aux.detach())
        if obj.router_aux_loss_coef:
            share = share + obj.router_aux_loss_coef * fwd.aux * (mask.sum() / step_tokens)
    if fwd.other is not None:  # |train - rollout| logprob with routing replay and without
        rollout = padded(mb, "rollout_logprobs", torch.float32).to(mask.device)
        gaps = {obj.routing_replay: fwd.logp.detach(), not obj.routing_replay: fwd.other}
        for replayed, name in ((True, "replay"), (False, "no_replay")):
            metrics[f"moe/logprob_diff_{name}"] = float(((gaps[replayed] - rollout).abs() * mask).sum()
                                                       / mask.sum().clamp_min(1))
    return share, metrics


def policy_loss(logp: Tensor, mb: pa.RecordBatch, mask: Tensor, obj: ObjectiveConfig, step_tokens: int,
                step_seqs: int, entropy: Tensor | None = None) -> tuple[Tensor, dict[str, float]]:
    """The micro-batch's share of the step loss (0-dim) from the trainer's logprobs ``logp`` [B, T] and
    the batch's columns (``rollout_logprobs``, ``advantages``, ``ref_logprobs``; SFT records have
    neither of the first two), and its token metrics; steps 2's c, L and share of the module docstring."""
    dev = logp.device
    rollout, adv = (padded(mb, name, torch.float32).to(dev) if name in mb.schema.names else torch.zeros_like(logp)
                    for name in ("rollout_logprobs", "advantages"))
    corr = obj.correction.compute(logp, rollout, mask)
    old = rollout if obj.anchor == "rollout" else logp.detach()
    pl = obj.policy_loss.compute(logp, old, adv, corr.keep)
    per_token = apply_correction(pl.per_token_loss, corr)
    token_kl = None
    if obj.kl is not None:
        token_kl = obj.kl.per_token(logp, padded(mb, "ref_logprobs", torch.float32).to(dev), mask)
        per_token = per_token + obj.kl.coef * token_kl
    share = obj.aggregation.reduce(per_token, mask, step_tokens, step_seqs)
    return share, policy_step_metrics(mask, adv, pl, corr, logp, rollout, token_kl, entropy)


def zero_advantage_is_inert(obj: ObjectiveConfig) -> bool:
    """Whether a token with advantage 0 adds no gradient under ``obj``: no KL term, and the policy
    loss with its correction, evaluated at advantage 0 on a probe, has an exactly zero gradient
    (true of PPO, GSPO and CISPO, whose per-token loss is a multiple of the advantage)."""
    if obj.kl is not None:
        return False
    logp = torch.tensor([[-1.0, -2.0, -0.5]], requires_grad=True)
    rollout = torch.tensor([[-1.2, -1.5, -0.5]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    corr = obj.correction.compute(logp, rollout, mask)
    old = rollout if obj.anchor == "rollout" else logp.detach()
    per_token = apply_correction(obj.policy_loss.compute(logp, old, torch.zeros(1, 3), corr.keep).per_token_loss, corr)
    (grad,) = torch.autograd.grad(obj.aggregation.reduce(per_token, mask, 3, 1), logp, allow_unused=True)
    return grad is None or not bool(grad.any())


def inert_rows(batch: pa.RecordBatch, obj: ObjectiveConfig) -> np.ndarray:
    """[N] bool: rows whose ``advantages`` are 0 on every loss token, when that adds no gradient
    (`zero_advantage_is_inert`), e.g. a GRPO group whose rollouts all scored the same. The
    trainer skips their forward and backward; their tokens still count in the step's loss
    denominators (``step_loss_tokens``/``step_loss_seqs``), so the loss and update are unchanged,
    while the step's token metrics cover the other rows only (``rows/inert_frac``: the share skipped; 1
    means the step had no policy gradient, e.g. every group's rewards were equal). A MoE's auxiliary
    load-balancing loss is then computed over the forwarded rows only."""
    if batch.num_rows == 0 or not zero_advantage_is_inert(obj):
        return np.zeros(batch.num_rows, dtype=bool)
    return np.array([not any(a != 0 and m for a, m in zip(adv, mask)) for adv, mask in
                     zip(batch.column("advantages").to_pylist(), batch.column("loss_mask").to_pylist())])


def accumulate(model: PolicyModel, batch: pa.RecordBatch, obj: ObjectiveConfig,
               rank: int, world_size: int) -> tuple[float, list[dict[str, float]]]:
    """Forward/backward every micro-batch of ``rank``; returns (sum of shares, metrics)."""
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
    """Clip the global grad norm (all ranks), step, zero grads, `release_freed_memory`; returns the pre-clip norm."""
    params = [p for p in model.parameters() if p.grad is not None]
    norm = torch.nn.utils.clip_grad_norm_(params, grad_clip if grad_clip is not None else math.inf)
    full = norm.full_tensor() if hasattr(norm, "full_tensor") else norm
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    release_freed_memory()
    return float(full)


def reduce_metrics(parts: list[dict[str, float]], keys: list[str]) -> dict[str, float]:
    """Merge micro-batch metrics on this rank, then across ranks by each key's reduction.

    Ranks without a valid token contribute nothing to means, maxima or minima.
    """
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
            out[key] = float(summed[i]) if key.endswith(("count", "sum")) else float(summed[i]) / max(total, 1.0)
    return out


def metric_keys(obj: ObjectiveConfig) -> list[str]:
    """The metric keys a micro-batch yields under ``obj`` (identical on every rank)."""
    zeros, mask = torch.zeros(1, 1), torch.zeros(1, 1, dtype=torch.bool)
    corr = obj.correction.compute(zeros, zeros, mask)
    pl = obj.policy_loss.compute(zeros, zeros, zeros, mask)
    return sorted(policy_step_metrics(mask, zeros, pl, corr, zeros, zeros, zeros if obj.kl else None, zeros))


def train_step(model: PolicyModel, optimizer: torch.optim.Optimizer, batch: pa.RecordBatch,
               obj: ObjectiveConfig, optim_cfg: OptimConfig, version: int) -> StepResult:
    """One optimizer step on this rank's rows of ``batch`` (module docstring, steps 2-3).

    ``version`` is the number of optimizer steps already taken (sets the lr). The
    caller checks staleness first (`check_staleness`).
    """

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
    metrics["rows/inert_frac"] = float(inert_rows(batch, obj).mean()) if batch.num_rows else 0.0  # 1: no gradient
    return StepResult(float(loss), grad_norm, lr, num_tokens, metrics)


STEP_SCHEMA = make_schema([
    pa.field("step", pa.int32(), metadata={b"doc": b"optimizer step just taken, from 0"}),
    pa.field("policy_version", pa.int32(), metadata={b"doc": b"optimizer steps in the weights now (step + 1)"}),
    pa.field("num_rows", pa.int64(),
             metadata={b"doc": b"rows trained in the step (0: a resumed trainer's first record)"}),
    pa.field("num_tokens", pa.int64(), metadata={b"doc": b"tokens forwarded (prompt + completion)"}),
    pa.field("num_loss_tokens", pa.int64(), metadata={b"doc": b"loss_mask tokens of the step"}),
    pa.field("loss", pa.float64(), metadata={b"doc": b"step loss (sum of every micro-batch share)"}),
    pa.field("grad_norm", pa.float64(), metadata={b"doc": b"global grad L2 norm before clipping"}),
    pa.field("lr", pa.float64(), metadata={b"doc": b"learning rate of the step (before optim.lr_scale)"}),
    pa.field("reward_mean", pa.float64(), metadata={b"doc": b"mean reward of the step's rows (0 if none)"}),
    pa.field("max_lag", pa.int32(), metadata={b"doc": b"largest version lag of a generated token"}),
    pa.field("step_seconds", pa.float64(), metadata={b"doc": b"wall time of the step (s)"}),
], "train_step")
