"""Logprobs of target tokens at a sampling temperature, chunked over tokens.

    logp_t = z_t[y_t] - lse_t,   z_t = h_t W^T / tau,   lse_t = log sum_v exp(z_tv)

with h [N, H], W [V, H], y [N], computed ``chunk_tokens`` rows at a time in fp32, so at most
[chunk_tokens, V] logits exist at once. The backward recomputes each chunk's p_t from lse:

    dz_t = g_t / tau * (onehot(y_t) - p_t),   grad_h = dz @ W,   grad_W = dz^T @ h   (g upstream)

The last chunk's p is kept from the forward and its backward runs first, so one chunk costs no
recompute. ``with_entropy`` also gives each token's entropy (no gradient):

    H_t = log S_t - sum_v e_tv log e_tv / S_t,   e_tv = exp(z_tv - max_v z_tv),   S_t = sum_v e_tv

Shape legend: N tokens, n of a chunk, H hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _logits(hidden: Tensor, weight: Tensor, temperature: float) -> Tensor:
    """z [n, V] = (h / tau) W^T in fp32 (``weight`` already fp32) even under bf16 compute:
    importance ratios are sensitive to logprob error."""
    return (hidden.float() / temperature) @ weight.t()


def _logp_lse(logits: Tensor, targets: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(logp [n], lse [n], row sums [n]) of ``logits`` [n, V]; leaves exp(z - max z) in
    ``logits`` (in place: a chunk holds one [n, V] buffer)."""
    picked = logits.gather(1, targets[:, None])[:, 0]
    top = logits.amax(1)
    sums = logits.sub_(top[:, None]).exp_().sum(1)
    lse = top + sums.log()
    return picked - lse, lse, sums


class _TargetLogprobs(torch.autograd.Function):
    """Chunked logp of targets (module docstring)."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor,  # type: ignore[override]
                temperature: float, chunk_tokens: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
        w = weight.float()
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        lse = torch.empty_like(out)
        entropy = torch.empty_like(out) if with_entropy else out.new_empty(0)
        ctx.probs = None
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            logits = _logits(hidden[start:end], w, temperature)  # [n, V]
            out[start:end], lse[start:end], sums = _logp_lse(logits, targets[start:end])
            if with_entropy:
                entropy[start:end] = sums.log() - torch.xlogy(logits, logits).sum(1) / sums
            if end >= hidden.shape[0] and any(ctx.needs_input_grad[:2]):
                ctx.probs = logits.div_(sums[:, None])  # p of the last chunk, for the backward
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        ctx.mark_non_differentiable(entropy)
        return out, entropy

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor,  # type: ignore[override]
                 _: Tensor) -> tuple[Tensor | None, ...]:
        hidden, weight, targets, lse = ctx.saved_tensors
        w, n, tau = weight.float(), hidden.shape[0], ctx.temperature
        grad_hidden = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        starts = list(range(0, n, ctx.chunk_tokens))
        for start in starts[-1:] + starts[:-1]:  # the kept chunk first, then it is freed
            end = start + ctx.chunk_tokens
            h, y, g = hidden[start:end], targets[start:end], grad_out[start:end] / tau
            if ctx.probs is not None:
                probs, ctx.probs = ctx.probs, None
            else:
                probs = _logits(h, w, tau).sub_(lse[start:end, None]).exp_()
            dz = probs.mul_(-g[:, None])  # [n, V] gradient w.r.t. the logits z, in place
            dz[torch.arange(len(y), device=dz.device), y] += g
            if grad_hidden is not None:
                grad_hidden[start:end] = (dz @ w).to(hidden.dtype)
            grad_weight.addmm_(dz.t(), h.float())
            del probs, dz
        grad_w = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w, None, None, None, None


def target_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                    chunk_tokens: int = 1024) -> Tensor:
    """[N] fp32 logprob of ``targets`` [N] under ``softmax(hidden @ weight.T / temperature)``.

    Example: hidden [[1., 0.]], weight [[1., 0.], [0., 0.]], target [0], temperature 1
    -> log(e / (e + 1)) = [-0.3133].

    Raises:
        ValueError: temperature <= 0, chunk_tokens < 1.
    """
    return target_logprobs_entropy(hidden, weight, targets, temperature, chunk_tokens,
                                   with_entropy=False)[0]


def target_logprobs_entropy(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                            chunk_tokens: int = 1024,
                            with_entropy: bool = True) -> tuple[Tensor, Tensor]:
    """(`target_logprobs` [N], entropy [N] in nats, no gradient; [0] without ``with_entropy``).

    Example: the one above -> ([-0.3133], [0.5822]) (-p log p - q log q, p = e / (e + 1)).

    Raises:
        ValueError: temperature <= 0, chunk_tokens < 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}; hint: the pipeline's "
                         "policy.temperature is the rollout's sampling temperature (greedy "
                         "rollouts cannot be trained)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    return _TargetLogprobs.apply(  # type: ignore[no-any-return]
        hidden, weight, targets, temperature, chunk_tokens, with_entropy)
