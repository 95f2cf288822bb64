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

`RouterProbe` watches every router's output during the trainer's forwards: per-layer,
per-expert load (how many top-k slots each expert got) for the step's metrics, and the
router logits for the optional auxiliary load-balancing loss (Switch Transformer,
Fedus et al. 2021, arXiv 2101.03961, eqs. 4-6, through transformers'
``load_balancing_loss_func``). Expert parallelism is in molt.train.expert_parallel.
"""

from __future__ import annotations

from typing import Any, cast

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


class RouterProbe:
    """Forward hooks on the L routers of a MoE model: expert load and router logits.

    A transformers router returns ``(router_logits [T, E], scores [T, k], indices [T, k])``.
    While ``active``, each forward adds the bincount of ``indices`` to ``counts`` [L, E]
    (float64, summed until `take_counts`) and keeps the logits of the latest forward in
    ``logits`` (L tensors [T, E], still in the autograd graph) for `aux_loss`.
    """

    def __init__(self, lm: nn.Module) -> None:
        found: list[Any] = routers(lm)
        self.num_experts, self.top_k = int(found[0].num_experts), int(found[0].top_k)
        self.counts = torch.zeros(len(found), self.num_experts, dtype=torch.float64)
        self.logits: list[torch.Tensor] = []
        self.active = True
        for layer, router in enumerate(found):
            router.register_forward_hook(self._hook(layer))

    def _hook(self, layer: int):  # type: ignore[no-untyped-def]
        def hook(module: nn.Module, args: tuple, output: tuple) -> None:
            if not self.active:
                return
            logits, _, indices = output
            if layer == 0:
                self.logits = []
            self.logits.append(logits)
            self.counts[layer] += torch.bincount(indices.reshape(-1).cpu(), minlength=self.num_experts).double()
        return hook

    def aux_loss(self) -> torch.Tensor:
        """Switch Transformer load-balancing loss of the latest forward (0-dim, fp32):
        E * sum_e f_e * P_e, f_e the share of top-k slots routed to expert e, P_e the mean router
        probability of e, both over the forward's tokens and all layers; k when perfectly balanced."""
        from transformers.models.mixtral.modeling_mixtral import load_balancing_loss_func

        logits = cast(Any, tuple(t.float() for t in self.logits))
        return cast(torch.Tensor, load_balancing_loss_func(logits, self.num_experts, self.top_k))

    def take_counts(self) -> torch.Tensor:
        """The load counts [L, E] summed since the last call; resets them."""
        counts, self.counts = self.counts, torch.zeros_like(self.counts)
        return counts


def load_metrics(counts: torch.Tensor) -> dict[str, float]:
    """Step metrics of expert load from top-k slot counts [L, E] (summed over ranks).

    ``moe/load_max``: the largest load of an expert over the mean load of its layer (1.0 =
    perfectly balanced, E = everything on one expert), max over layers;
    ``moe/load_cv``: coefficient of variation of the load within a layer, mean over layers;
    ``moe/expert_share/e{j}``: expert j's share of all slots, summed over layers.
    """
    mean = counts.mean(dim=1).clamp_min(1e-12)  # [L]
    out = {"moe/load_max": float((counts.max(dim=1).values / mean).max()),
           "moe/load_cv": float((counts.std(dim=1, unbiased=False) / mean).mean())}
    share = counts.sum(dim=0) / counts.sum().clamp_min(1e-12)
    out.update({f"moe/expert_share/e{j}": float(v) for j, v in enumerate(share)})
    return out
