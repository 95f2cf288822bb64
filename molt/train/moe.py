"""Mixture-of-experts policies in the trainer: routers found by structure, kept in fp32, optionally frozen.

A transformers MoE block (Mixtral's ``MixtralSparseMoeBlock``, Qwen3-MoE's
``Qwen3MoeSparseMoeBlock``) is a module with an ``experts`` child and a ``gate``
child, the router: logits = W_r h [T, E], softmax, top-k. Routing decisions are
discrete, so rounding in the router flips experts: the router runs in fp32 even
when the rest computes in bf16 (`fp32_router_policy`: FSDP2 keeps its parameters
fp32 and casts its inputs to fp32); DeepSeek-V3's report (arXiv 2412.19437, §3.3)
likewise keeps its gating modules in their original precision under low-precision
training.

``freeze_router``: the routers get no gradient and no optimizer state, so their
weights stay bit-identical across steps while the experts train.

`RouterHooks` watches every router's output during the trainer's forwards: per-layer,
per-expert load (how many top-k slots each expert got) for the step's metrics, agreement
with the engine's routing and routing replay (R3), and the router logits for the optional
auxiliary load-balancing loss (Switch Transformer,
Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6, through transformers'
``load_balancing_loss_func``). Expert parallelism is in molt.train.expert_parallel.
"""

from __future__ import annotations

from typing import Any, cast

import numpy as np
import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def moe_blocks(lm: nn.Module) -> list[nn.Module]:
    """Every MoE block of ``lm`` (a module with ``experts`` and ``gate`` children), in module order."""
    return [module for module in lm.modules() if isinstance(getattr(module, "experts", None), nn.Module)
            and isinstance(getattr(module, "gate", None), nn.Module)]


def routers(lm: nn.Module) -> list[nn.Module]:
    """The router (``gate``) of every MoE block of ``lm``, in module order; [] for a dense model."""
    return [cast(nn.Module, block.gate) for block in moe_blocks(lm)]


def fp32_router_policy() -> MixedPrecisionPolicy:
    """FSDP2 MixedPrecisionPolicy of a router: fp32 parameters and reduction, inputs cast to fp32."""
    return MixedPrecisionPolicy(param_dtype=torch.float32, reduce_dtype=torch.float32, cast_forward_inputs=True)


def freeze_routers(lm: nn.Module, where: str) -> int:
    """Turn off gradients of every router parameter; returns how many tensors were frozen.

    Raises:
        ValueError: ``lm`` has no MoE router (``where``: the YAML key that asked).
    """
    found = routers(lm)
    if not found:
        raise ValueError(f"{where}: the model has no mixture-of-experts router to freeze; hint: remove the key "
                         "for a dense model")
    params = [p for router in found for p in router.parameters()]
    for param in params:
        param.requires_grad_(False)
    return len(params)


def apply_moe_keys(config: Any, lm: nn.Module, where: str) -> None:
    """Refuse MoE-only train keys (``router_aux_loss_coef``, ``routing_replay``,
    ``routing_replay_compare``) for a dense model, and the aux loss with ``freeze_router``;
    then freeze ``lm``'s routers if ``freeze_router`` (`freeze_routers`).

    Raises:
        ValueError: naming the key under ``where`` (e.g. ``stages.train.config.routing_replay``).
    """
    keys = ("router_aux_loss_coef", "routing_replay", "routing_replay_compare")
    has_router = bool(routers(lm))
    for key in (k for k in keys if getattr(config, k) and not has_router):
        raise ValueError(f"{where}.{key}: the model has no mixture-of-experts router; hint: remove the key "
                         "for a dense model")
    if config.router_aux_loss_coef and config.freeze_router:
        raise ValueError(f"{where}.router_aux_loss_coef: frozen routers (freeze_router) cannot learn from it; "
                         "hint: router_aux_loss_coef: 0")
    if config.freeze_router:
        freeze_routers(lm, f"{where}.freeze_router")


class RouterHooks:
    """Forward hooks on the L routers of a MoE model: expert load, router logits, routing replay.

    A transformers router returns ``(router_logits [T, E], scores [T, k], indices [T, k])``.
    While ``active``, each forward adds the bincount of ``indices`` to ``counts`` [L, E]
    (float64, summed until `take_counts`) and keeps the logits of the latest forward in
    ``logits`` (L tensors [T, E], still in the autograd graph) for `aux_loss`.

    Routing replay (R3, Ma et al. 2025, arXiv 2510.11370): when ``engine_routing`` is set
    (int64 [T, L, k], the experts the engine routed each token to, -1 where it routed
    none), every router compares its own top-k set with the engine's on the routed tokens
    (``routing`` [5]: routed (token, layer) pairs, pairs whose sets differ, routed tokens,
    tokens differing in any layer, all tokens; summed until `take_counts`) and, with ``replay`` on,
    returns the engine's experts instead: indices = the engine's where routed, its own
    elsewhere; scores = softmax(logits) at those indices, renormalised over the k when the
    router renormalises (Mixtral; Qwen3-MoE's ``norm_topk_prob``), so gradients still
    reach the router through the recomputed logits.
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
            router.register_forward_hook(self._hook(layer, bool(getattr(router, "norm_topk_prob", True))))

    def _hook(self, layer: int, renormalise: bool):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: tuple) -> tuple | None:
            if not self.active:
                return None
            logits, scores, indices = output
            if layer == 0:
                self.logits = []
            self.logits.append(logits)
            if self.engine_routing is not None:
                indices, scores = self._compare_and_replay(layer, logits, scores, indices, renormalise)
            self.counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts).double()
            return logits, scores, indices
        return hook

    def _compare_and_replay(self, layer: int, logits: torch.Tensor, scores: torch.Tensor, indices: torch.Tensor,
                            renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
        engine = self.engine_routing[:, layer].to(indices.device)  # type: ignore[index]
        routed = engine[:, 0] >= 0  # [T]
        differs = (engine.sort(-1).values != indices.sort(-1).values).any(-1) & routed
        self._differs = differs if layer == 0 or self._differs is None else self._differs | differs
        self.routing[0] += float(routed.sum())
        self.routing[1] += float(differs.sum())
        if layer == self.num_layers - 1:
            self.routing[2:] += torch.tensor([float(routed.sum()), float(self._differs.sum()), len(routed)])
        if not self.replay:
            return indices, scores
        indices = torch.where(routed[:, None], engine, indices)
        chosen = torch.softmax(logits.float(), dim=-1).gather(-1, indices)
        if renormalise:
            chosen = chosen / chosen.sum(dim=-1, keepdim=True)
        return indices, chosen.to(scores.dtype)

    def aux_loss(self) -> torch.Tensor:
        """Switch Transformer load-balancing loss of the latest forward (0-dim, fp32):
        E * sum_e f_e * P_e, f_e the share of top-k slots routed to expert e, P_e the mean router
        probability of e, both over the forward's tokens and all layers; k when perfectly balanced."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        logits = cast(Any, tuple(t.float() for t in self.logits))
        return cast(torch.Tensor, load_balancing_loss_func(logits, self.num_experts, self.top_k))

    def take_counts(self) -> torch.Tensor:
        """The load counts [L, E] and routing comparison counts [5], concatenated into [L * E + 5],
        summed since the last call; resets them."""
        out = torch.cat([self.counts.reshape(-1), self.routing])
        self.counts, self.routing = torch.zeros_like(self.counts), torch.zeros_like(self.routing)
        return out


def load_metrics(counts: torch.Tensor, num_experts: int) -> dict[str, float]:
    """Step metrics of expert load and routing agreement from `RouterHooks.take_counts` (summed over ranks).

    ``moe/load_max``: the largest load of an expert over the mean load of its layer (1.0 =
    perfectly balanced, E = everything on one expert), max over layers;
    ``moe/load_cv``: coefficient of variation of the load within a layer, mean over layers;
    ``moe/expert_share/e{j}``: expert j's share of all slots, summed over layers;
    with the engine's routing: ``moe/routing_disagreement`` (routed (token, layer) pairs whose
    trainer top-k set differs from the engine's), ``moe/routing_disagreement_tokens``
    (routed tokens differing in at least one layer) and ``moe/routed_token_frac`` (tokens
    the engine routed, of all forwarded), fractions in [0, 1].
    """
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
                          token_index: torch.Tensor, num_packed: int, hooks: RouterHooks) -> torch.Tensor:
    """int64 [S, L, k]: the engine's experts at every packed position of a micro-batch, -1 where none.

    ``values``: each row's ``routed_experts`` (int16 bytes of [T, L, k], -1 = not routed; null =
    not recorded); ``token_index`` [sum T] the packed position of each row token (molt.train.packing).
    Rows sharing a packed prompt position give it the first routed value among them.

    Raises:
        ValueError: naming column ``routed_experts`` and the sample, when a row's size is not
            T x L x k x 2 bytes for the trained model or holds an expert id >= E.
    """
    num_layers, top_k = hooks.num_layers, hooks.top_k
    out = torch.full((num_packed, num_layers, top_k), -1, dtype=torch.int64)
    offset = 0
    for value, sample_id, n in zip(values, sample_ids, lengths):
        if value is not None:
            if len(value) != n * num_layers * top_k * 2:
                raise ValueError(f"column 'routed_experts', sample {sample_id!r}: {len(value)} bytes, expected "
                                 f"{n} tokens x {num_layers} MoE layers x top-{top_k} x 2 (int16) = "
                                 f"{n * num_layers * top_k * 2}; hint: the engine must serve the trained model")
            rows = torch.from_numpy(np.frombuffer(value, np.int16).reshape(n, num_layers, top_k).astype(np.int64))
            if rows.numel() and int(rows.max()) >= hooks.num_experts:
                raise ValueError(f"column 'routed_experts', sample {sample_id!r}: expert id {int(rows.max())} >= "
                                 f"the model's {hooks.num_experts} experts")
            index = token_index[offset:offset + n]
            current = out[index]
            out[index] = torch.where(current >= 0, current, rows)
        offset += n
    return out
