"""Expert parallelism: each of W ranks holds E/W of each MoE layer's experts; tokens go to them.

Dense parameters are FSDP-sharded as usual; the experts' stacked weights become ``Shard(0)``
DTensors that FSDP ignores. A layer's forward (GShard, arXiv 2006.16668):

    slots: the T k (token, expert) pairs of top-k routing, sorted by expert (so by owner rank)
    all-to-all #0: slot counts per (rank, expert)                     [W, E/W]
    all-to-all #1: the slots' hidden states to their owners           [T k, H]
    each owner runs its experts (SwiGLU: down(act(gate) * up))
    all-to-all #2: results back; weight by routing score, sum each token's k slots   [T, H]

Expert gradients sum every rank's contribution while FSDP averages dense ones (the trainer
scales shares by W), so they are divided by W (`_ScaleGrad`). Its size must be the world size.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.device_mesh import DeviceMesh

from molt.train.moe import moe_blocks


class _ScaleGrad(torch.autograd.Function):
    """Identity forward; the gradient times ``scale`` backward."""

    @staticmethod
    def forward(ctx, tensor: Tensor, scale: float) -> Tensor:  # type: ignore[override]
        ctx.scale = scale
        return tensor.view_as(tensor)

    @staticmethod
    def backward(ctx, grad: Tensor) -> tuple[Tensor, None]:  # type: ignore[override]
        return grad * ctx.scale, None


class ExpertParallel:
    """Mixin before a transformers experts class: its ``forward(hidden [T, H], top_k_index [T, k],
    top_k_weights [T, k]) -> [T, H]`` over all-to-alls; ``num_experts`` stays the global E."""

    gate_up_proj: nn.Parameter
    down_proj: nn.Parameter
    num_experts: int
    act_fn: nn.Module
    ep_group: dist.ProcessGroup

    def forward(self, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
        from torch.distributed._functional_collectives import all_to_all_single_autograd

        world = dist.get_world_size(self.ep_group)
        local = self.num_experts // world
        slots = top_k_index.reshape(-1)  # [T k] expert of each (token, choice)
        order = torch.argsort(slots, stable=True)  # slots grouped by expert, so by owner rank
        token_of = torch.div(order, top_k_index.shape[1], rounding_mode="floor")
        per_expert = torch.bincount(slots, minlength=self.num_experts)  # [E]
        received = torch.empty_like(per_expert)
        # [W * local]: slots from rank s for local expert j
        dist.all_to_all_single(received, per_expert, group=self.ep_group)
        send_splits = per_expert.view(world, local).sum(1).tolist()
        recv_splits = received.view(world, local).sum(1).tolist()
        inbox = all_to_all_single_autograd(hidden_states[token_of], recv_splits, send_splits,
                                           self.ep_group)
        expert_of_row = torch.arange(local, device=slots.device).repeat(world)
        expert_of_row = expert_of_row.repeat_interleave(received)
        # FSDP averages dense gradients over the world; expert gradients are summed
        params = (self.gate_up_proj, self.down_proj)
        gate_up, down = (_ScaleGrad.apply(p.to_local(), 1.0 / world)  # type: ignore[attr-defined]
                         .to(hidden_states.dtype) for p in params)
        outbox = torch.zeros_like(inbox)
        for j in range(local):
            rows = (expert_of_row == j).nonzero().squeeze(1)
            gate, up = nn.functional.linear(inbox[rows], gate_up[j]).chunk(2, dim=-1)
            out = nn.functional.linear(self.act_fn(gate) * up, down[j])
            outbox = outbox.index_add(0, rows, out)
        back = all_to_all_single_autograd(outbox, send_splits, recv_splits, self.ep_group)
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of, back * weights[:, None])


def shard_experts(lm: nn.Module, mesh: DeviceMesh, where: str) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over the 1-D ``mesh``; returns the new parameters.

    Raises:
        ValueError: naming ``where``: a dense model, experts not stored as stacked tensors, or E
            not divisible by the world size.
    """
    from torch.distributed.tensor import DTensor, Shard

    blocks = moe_blocks(lm)
    if not blocks:
        raise ValueError(f"{where}: the model has no mixture-of-experts layer to shard; hint: "
                         "expert parallelism needs a MoE model (e.g. smollm2-135m-instruct-moe)")
    world, rank = mesh.size(), mesh.get_local_rank()
    owned: set[nn.Parameter] = set()
    for block in blocks:
        experts: Any = block.experts
        names = ("gate_up_proj", "down_proj")
        if not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in names):
            raise ValueError(f"{where}: {type(experts).__name__} does not store its experts as "
                             "stacked gate_up_proj/down_proj tensors; hint: "
                             "expert_parallel_size: 1")
        if experts.num_experts % world:
            raise ValueError(f"{where}: {experts.num_experts} experts do not split over {world} "
                             "ranks; hint: the number of experts must be a multiple of the world "
                             "size")
        for name in names:
            full = getattr(experts, name)
            mine = full.detach().chunk(world, dim=0)[rank].clone()
            param = nn.Parameter(DTensor.from_local(mine, mesh, [Shard(0)], run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(experts, name, param)
            owned.add(param)
        cls = type(experts)
        experts.__class__ = type(f"ExpertParallel{cls.__name__}", (ExpertParallel, cls), {})
        experts.ep_group = mesh.get_group()
    return owned
