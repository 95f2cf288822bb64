"""Logprobs of target tokens at a sampling temperature, chunked over tokens.

    logp_t = log_softmax(h_t W^T / tau)[y_t]          h [N, H], W [V, H], y [N]

computed ``chunk_tokens`` rows at a time in fp32, so at most ``[chunk_tokens, V]``
logits exist at once, in the forward *and* the backward (a custom autograd function
saves only h, W and y, and recomputes each chunk's softmax in backward):

    d logp_t / d z_t = (onehot(y_t) - softmax(z_t)) / tau,   z_t = h_t W^T
    grad_h = sum over chunks of g * dz @ W,   grad_W = sum of (g * dz)^T @ h

Example: the full-vocab fp32 logits of 8,000 tokens of a 49,152-token vocabulary take
1.5 GiB; with chunk_tokens 1024 the peak is 0.2 GiB and the result is identical.

Shape legend: N tokens, H hidden size, V vocabulary.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor


def _chunk_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float) -> tuple[Tensor, Tensor]:
    """(logp [n] fp32, log_softmax [n, V] fp32) of one chunk; the projection runs in fp32
    even under bf16 compute, since importance ratios are sensitive to logprob error."""
    logits = (hidden.float() @ weight.float().t()) / temperature  # [n, V]
    log_probs = torch.log_softmax(logits, dim=-1)
    return log_probs.gather(-1, targets[:, None])[:, 0], log_probs


class _TargetLogprobs(torch.autograd.Function):
    """Chunked logp of targets; see the module docstring for forward and backward."""

    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, targets: Tensor,  # type: ignore[override]
                temperature: float, chunk_tokens: int) -> Tensor:
        ctx.save_for_backward(hidden, weight, targets)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        out = torch.empty(hidden.shape[0], dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0], chunk_tokens):
            end = start + chunk_tokens
            out[start:end] = _chunk_logprobs(hidden[start:end], weight, targets[start:end], temperature)[0]
        return out

    @staticmethod
    def backward(ctx: Any, grad_out: Tensor) -> tuple[Tensor | None, ...]:  # type: ignore[override]
        hidden, weight, targets = ctx.saved_tensors
        grad_hidden = torch.zeros_like(hidden) if ctx.needs_input_grad[0] else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_tokens):
            end = start + ctx.chunk_tokens
            h, y, g = hidden[start:end], targets[start:end], grad_out[start:end]
            _, log_probs = _chunk_logprobs(h, weight, y, ctx.temperature)
            dz = -log_probs.exp_()  # -softmax, in place
            dz[torch.arange(len(y), device=dz.device), y] += 1.0
            dz *= (g / ctx.temperature)[:, None]  # [n, V] gradient w.r.t. the logits z
            if grad_hidden is not None:
                grad_hidden[start:end] = (dz @ weight.float()).to(hidden.dtype)
            grad_weight += dz.t() @ h.float()
        grad_w = grad_weight.to(weight.dtype) if ctx.needs_input_grad[1] else None
        return grad_hidden, grad_w, None, None, None


def target_logprobs(hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float,
                    chunk_tokens: int = 1024) -> Tensor:
    """[N] fp32 logprob of ``targets`` [N] under ``softmax(hidden @ weight.T / temperature)``.

    Example: hidden [[1., 0.]], weight [[1., 0.], [0., 0.]], target [0], temperature 1
    -> log(e / (e + 1)) = [-0.3133].

    Raises:
        ValueError: temperature <= 0 (config ``temperature``), chunk_tokens < 1.
    """
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0; got {temperature}; hint: set the train stage's "
                         "temperature to the rollout's sampling temperature (greedy rollouts cannot be trained)")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
    return _TargetLogprobs.apply(hidden, weight, targets, temperature, chunk_tokens)  # type: ignore[no-any-return]
