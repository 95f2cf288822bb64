"""Mixture-of-experts policies in the trainer: routers found by structure, kept in fp32, or frozen.

A MoE block (Mixtral, Qwen3-MoE) has ``experts`` and ``gate`` (the router: logits [T, E], top-k)
children. Rounding flips discrete expert choices, so routers run in fp32 even under bf16, as in
DeepSeek-V3 (arXiv 2412.19437, §3.3). `RouterHooks` give expert load, routing replay and the
logits of the Switch Transformer load-balancing loss (arXiv 2101.03961, eqs. 4-6).
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def moe_blocks(lm: nn.Module) -> list[nn.Module]:
    """Every module of ``lm`` with ``experts`` and ``gate`` children, in module order."""
    return [module for module in lm.modules()
            if isinstance(getattr(module, "experts", None), nn.Module)
            and isinstance(getattr(module, "gate", None), nn.Module)]


def routers(lm: nn.Module) -> list[nn.Module]:
    """The ``gate`` of every MoE block of ``lm``, in module order; [] for a dense model."""
    return [cast(nn.Module, block.gate) for block in moe_blocks(lm)]


def fp32_router_policy() -> MixedPrecisionPolicy:
    """FSDP2 policy of a router: fp32 parameters and reduction, inputs cast to fp32."""
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32,
                                cast_forward_inputs=True)


def freeze_routers(lm: nn.Module, where: str) -> int:
    """Turn off gradients of every router parameter; returns how many tensors were frozen.

    Raises:
        ValueError: ``lm`` has no MoE router (``where``: the YAML key that asked).
    """
    found = routers(lm)
    if not found:
        raise ValueError(f"{where}: the model has no mixture-of-experts router to freeze; hint: "
                         "remove the key for a dense model")
    params = [p for router in found for p in router.parameters()]
    for param in params:
        param.requires_grad_(False)
    return len(params)


def apply_moe_keys(config: Any, lm: nn.Module, where: str) -> None:
    """Refuse MoE-only keys for a dense model and the aux loss with frozen routers; freeze them.

    Raises:
        ValueError: naming the key under ``where``.
    """
    keys = ("router_aux_loss_coef", "routing_replay", "routing_replay_compare")
    has_router = bool(routers(lm))
    for key in (k for k in keys if getattr(config, k) and not has_router):
        raise ValueError(f"{where}.{key}: the model has no mixture-of-experts router; hint: "
                         "remove the key for a dense model")
    if config.router_aux_loss_coef and config.freeze_router:
        raise ValueError(f"{where}.router_aux_loss_coef: frozen routers (freeze_router) cannot "
                         "learn from it; hint: router_aux_loss_coef: 0")
    if config.freeze_router:
        freeze_routers(lm, f"{where}.freeze_router")


class RouterHooks:
    """Forward hooks on the L routers: expert load ``counts`` [L, E], logits for `aux_loss`.

    Routing replay (R3, arXiv 2510.11370): with ``engine_routing`` (int64 [T, L, k], -1: none),
    top-k sets are compared with the engine's (``routing``: routed and differing pairs, routed
    and differing tokens, all tokens) and, with ``replay``, the engine's experts are returned,
    scored by softmax(logits), so gradients still reach the router.
    """

    def __init__(self, lm: nn.Module) -> None:
        found: list[Any] = routers(lm)
        self.num_layers = len(found)
        self.num_experts, self.top_k = int(found[0].num_experts), int(found[0].top_k)
        self.counts = torch.zeros(self.num_layers, self.num_experts, dtype=torch.float64)
        self.routing = torch.zeros(5, dtype=torch.float64)
        self.logits: list[torch.Tensor] = []
        self.active = True
        self.replay = False
        self.engine_routing: torch.Tensor | None = None
        self._differs: torch.Tensor | None = None  # [T] bool: any layer so far differs
        for layer, router in enumerate(found):
            renormalise = bool(getattr(router, "norm_topk_prob", True))  # Mixtral: always
            router.register_forward_hook(self._hook(layer, renormalise))

    def _hook(self, layer: int, renormalise: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            if not self.active:
                return None
            logits, scores, indices = output
            if layer == 0:
                self.logits = []
            self.logits.append(logits)
            if self.engine_routing is not None:
                indices, scores = self._compare_and_replay(layer, logits, scores, indices,
                                                           renormalise)
            load = torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts)
            self.counts[layer] += load.double()
            return logits, scores, indices
        return hook

    def _compare_and_replay(self, layer: int, logits: torch.Tensor, scores: torch.Tensor,
                            indices: torch.Tensor,
                            renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engine_routing[:, layer].to(indices.device)  # type: ignore[index]
        routed = engine[:, 0] >= 0  # [T]
        differs = (engine.sort(-1).values != indices.sort(-1).values).any(-1) & routed
        self._differs = differs if layer == 0 or self._differs is None else self._differs | differs
        self.routing[0] += float(routed.sum())
        self.routing[1] += float(differs.sum())
        if layer == self.num_layers - 1:
            tokens = [float(routed.sum()), float(self._differs.sum()), len(routed)]
            self.routing[2:] += torch.tensor(tokens)
        if not self.replay:
            return indices, scores
        indices = torch.where(routed[:, None], engine, indices)
        chosen = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
        if renormalise:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return indices, chosen.to(scores.dtype)

    def aux_loss(self) -> torch.Tensor:
        """Switch load-balancing loss of the latest forward (0-dim): E * sum_e f_e * P_e, f_e the
        share of slots routed to expert e, P_e its mean router probability; k when balanced."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        logits = cast(Any, tuple(t.float() for t in self.logits))
        return cast(torch.Tensor, load_balancing_loss_func(logits, self.num_experts, self.top_k))

    def take_counts(self) -> torch.Tensor:
        """[L * E + 5]: ``counts`` and ``routing`` summed since the last call; resets them."""
        out = torch.cat([self.counts.reshape(-1), self.routing])
        self.counts, self.routing = torch.zeros_like(self.counts), torch.zeros_like(self.routing)
        return out


def load_metrics(counts: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Step metrics of `RouterHooks.take_counts` summed over ranks: ``moe/load_max`` (an expert's
    load over its layer's mean), ``moe/load_cv``, expert shares, routing disagreement."""
    routing = counts[-5:]
    counts = counts[:-5].reshape(-1, num_experts)
    mean = counts.mean(dim=1).clamp_min(1e-12)  # [L]
    out = {"moe/load_max": float((counts.max(dim=1).values / mean).max()),
           "moe/load_cv": float((counts.std(dim=1, unbiased=False) / mean).mean())}
    share = counts.sum(dim=0) / counts.sum().clamp_min(1e-12)
    out.update({f"moe/expert_share/e{j}": float(v) for j, v in enumerate(share)})
    if routing[0] > 0:
        out["moe/routing_disagreement"] = float(routing[1] / routing[0])
        out["moe/routing_disagreement_tokens"] = float(routing[3] / routing[2])
    if routing[4] > 0:
        out["moe/routed_token_frac"] = float(routing[2] / routing[4])
    return out


def packed_engine_routing(values: list[bytes | None], sample_ids: list[str], lengths: list[int],
                          token_index: torch.Tensor, num_packed: int,
                          hooks: RouterHooks) -> torch.Tensor:
    """int64 [S, L, k]: the engine's experts at each packed position (-1: none) from each row's
    ``routed_experts`` (int16 bytes of [T, L, k], or null).

    Raises:
        ValueError: a row not T x L x k x 2 bytes, or an expert id >= E.
    """
    num_layers, top_k = hooks.num_layers, hooks.top_k
    out = torch.full((num_packed, num_layers, top_k), -1, dtype=torch.int64)
    offset = 0
    for value, sample_id, n in zip(values, sample_ids, lengths):
        if value is not None:
            if len(value) != n * num_layers * top_k * 2:
                raise ValueError(f"column 'routed_experts', sample {sample_id!r}: {len(value)} "
                                 f"bytes, expected {n} tokens x {num_layers} MoE layers x "
                                 f"top-{top_k} x 2 (int16) = {n * num_layers * top_k * 2}; hint: "
                                 "the engine must serve the trained model")
            ids = np.frombuffer(value, np.int16).reshape(n, num_layers, top_k)
            rows = torch.from_numpy(ids.astype(np.int64))
            if rows.numel() and int(rows.max()) >= hooks.num_experts:
                raise ValueError(f"column 'routed_experts', sample {sample_id!r}: expert id "
                                 f"{int(rows.max())} >= the model's {hooks.num_experts} experts")
            index = token_index[offset:offset + n]
            current = out[index]
            out[index] = torch.where(current >= 0, current, rows)
        offset += n
    return out
