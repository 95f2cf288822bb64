"""Expert parallelism: each rank holds E/W of every MoE layer's experts; tokens travel to them.

Composed with FSDP2 on the same world of W ranks: the dense parameters (attention,
norms, embeddings, routers) are FSDP-sharded and all-gathered for compute as usual;
the experts' stacked weights (transformers' fused ``experts.gate_up_proj [E, 2I, H]`` and
``experts.down_proj [E, H, I]``, Mixtral and Qwen3-MoE alike) become DTensors sharded on
the expert dimension, ``Shard(0)``, that FSDP ignores and nobody all-gathers. Rank r owns
experts [r E/W, (r+1) E/W). A layer's forward (GShard's dispatch/combine, arXiv 2006.16668):

    T tokens, top-k routing -> T k (token, expert) slots, sorted by expert (so by owner rank)
    all-to-all #0: how many slots each rank sends to each expert                  [W, E/W]
    all-to-all #1: the slots' hidden states to their owners                       [T k, H] out
    each owner runs its experts on what it received (SwiGLU: down(act(gate) * up))
    all-to-all #2: the results back, in the original order; weight by the routing
                   score and sum the k slots of each token                        [T, H]

Both data all-to-alls are differentiable (``all_to_all_single_autograd``), so the
backward sends gradients the reverse way. An expert's gradient then sums every rank's
contribution; the trainer multiplies each rank's loss share by W because FSDP *averages*
dense gradients (molt.train.step), so expert gradients are divided by W on the way in
(`_ScaleGrad`) to give the same update as without expert parallelism. Gradient
clipping, AdamW and the full state dicts (export, checkpoint) see ordinary DTensors.

Only an expert-parallel size equal to the data-parallel world size is supported: every
rank is one expert shard, so no second mesh dimension is needed.
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
    """Mixin placed before a transformers experts class (``MixtralExperts``, ``Qwen3MoeExperts``):
    the same ``forward(hidden [T, H], top_k_index [T, k], top_k_weights [T, k]) -> [T, H]``, with
    the local experts only and tokens dispatched by all-to-all (module docstring).
    ``num_experts`` stays the global E; the parameters are Shard(0) DTensors."""

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
        dist.all_to_all_single(received, per_expert, group=self.ep_group)  # [W * local]: from rank s, expert j
        send_splits = per_expert.view(world, local).sum(1).tolist()
        recv_splits = received.view(world, local).sum(1).tolist()
        inbox = all_to_all_single_autograd(hidden_states[token_of], recv_splits, send_splits, self.ep_group)
        expert_of_row = torch.arange(local, device=slots.device).repeat(world).repeat_interleave(received)
        scale = 1.0 / world  # FSDP averages dense gradients over the world; these are summed (module docstring)
        gate_up = _ScaleGrad.apply(self.gate_up_proj.to_local(), scale).to(hidden_states.dtype)  # type: ignore[attr-defined]
        down = _ScaleGrad.apply(self.down_proj.to_local(), scale).to(hidden_states.dtype)  # type: ignore[attr-defined]
        outbox = torch.zeros_like(inbox)
        for j in range(local):
            rows = (expert_of_row == j).nonzero().squeeze(1)
            gate, up = nn.functional.linear(inbox[rows], gate_up[j]).chunk(2, dim=-1)
            outbox = outbox.index_add(0, rows, nn.functional.linear(self.act_fn(gate) * up, down[j]))
        back = all_to_all_single_autograd(outbox, send_splits, recv_splits, self.ep_group)  # [T k, H] in `order`
        weights = top_k_weights.reshape(-1)[order].to(back.dtype)
        return torch.zeros_like(hidden_states).index_add(0, token_of, back * weights[:, None])


def shard_experts(lm: nn.Module, mesh: DeviceMesh, where: str) -> set[nn.Parameter]:
    """Shard every MoE layer's experts over the 1-D ``mesh`` (expert parallelism, module docstring);
    returns the new expert parameters, for ``fully_shard(..., ignored_params=...)``.

    Every rank must have loaded the same weights (it keeps its slice; no communication).

    Raises:
        ValueError: a dense model, experts that are not stacked ``gate_up_proj``/``down_proj``
            tensors, or E not divisible by the world size (``where``: the YAML key that asked).
    """
    from torch.distributed.tensor import DTensor, Shard

    blocks = moe_blocks(lm)
    if not blocks:
        raise ValueError(f"{where}: the model has no mixture-of-experts layer to shard; hint: expert "
                         "parallelism needs a MoE model (e.g. smollm2-135m-instruct-moe)")
    world, rank = mesh.size(), mesh.get_local_rank()
    owned: set[nn.Parameter] = set()
    for block in blocks:
        experts: Any = block.experts
        if not all(isinstance(getattr(experts, n, None), nn.Parameter) for n in ("gate_up_proj", "down_proj")):
            raise ValueError(f"{where}: {type(experts).__name__} does not store its experts as stacked "
                             "gate_up_proj/down_proj tensors; hint: expert_parallel_size: 1")
        if experts.num_experts % world:
            raise ValueError(f"{where}: {experts.num_experts} experts do not split over {world} ranks; "
                             "hint: the number of experts must be a multiple of the world size")
        for name in ("gate_up_proj", "down_proj"):
            full = getattr(experts, name)
            mine = full.detach().chunk(world, dim=0)[rank].clone()
            param = nn.Parameter(DTensor.from_local(mine, mesh, [Shard(0)], run_check=False),
                                 requires_grad=full.requires_grad)
            setattr(experts, name, param)
            owned.add(param)
        experts.__class__ = type(f"ExpertParallel{type(experts).__name__}", (ExpertParallel, type(experts)), {})
        experts.ep_group = mesh.get_group()
    return owned
