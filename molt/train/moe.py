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
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy


def routers(lm: nn.Module) -> list[nn.Module]:
    """The router (``gate``) of every MoE block of ``lm``, in module order; [] for a dense model."""
    found = []
    for module in lm.modules():
        gate = getattr(module, "gate", None)
        if isinstance(getattr(module, "experts", None), nn.Module) and isinstance(gate, nn.Module):
            found.append(gate)
    return found


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
