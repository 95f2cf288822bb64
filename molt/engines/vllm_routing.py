"""Routing capture inside vLLM's worker: the experts the engine chose for every token.

Routing replay (R3, Ma et al. 2025, arXiv 2510.11370) trains on exactly the top-k experts the
engine used; vLLM returns them only from its V2 model runner, which the CPU build lacks.
L = MoE layers, k = experts per token, B = KV block size.
- every router's `capture_fn` stores its layer's top-k ids [n, k];
- after each forward, rows go to requests (`query_start_loc`) and positions, into the request's
  record [positions, L, k] and a table by KV-cache slot (block id * B + offset);
- prompt tokens a request takes from the prefix cache are read from the slot table, i.e. from
  the forward that computed that KV cache.
Positions no forward routed hold -1 (the last sampled token).
"""

from __future__ import annotations

from functools import partial
from typing import Any

import numpy as np
import torch
from torch import nn

UNROUTED = -1


class RoutingRecorder:
    """Per-request routed experts of one vLLM worker; ValueError for a model without a MoE
    router vLLM can capture."""

    def __init__(self, runner: Any) -> None:
        from vllm.model_executor.layers.fused_moe.router.base_router import BaseRouter

        model: nn.Module = runner.get_model()
        routers = {}
        for module in model.modules():
            router = getattr(module, "router", None)
            if isinstance(router, BaseRouter) and hasattr(module, "layer_id"):
                routers[int(getattr(module, "layer_id"))] = router
        if not routers:
            raise ValueError("routing capture: the engine's model has no mixture-of-experts router "
                             "that vLLM lets us capture; hint: routing replay needs a MoE policy")
        self.layer_ids = sorted(routers)
        self.top_k = int(next(iter(routers.values())).top_k)
        self._step: list[torch.Tensor | None] = [None] * len(self.layer_ids)
        for index, layer_id in enumerate(self.layer_ids):
            routers[layer_id].set_capture_fn(partial(self._capture, index))
        self._runner = runner
        group = runner.kv_cache_config.kv_cache_groups[0]
        self._block_size = int(group.kv_cache_spec.block_size)
        num_slots = int(runner.kv_cache_config.num_blocks) * self._block_size
        shape = (len(self.layer_ids), self.top_k)
        self._slots = np.full((num_slots, *shape), UNROUTED, dtype=np.int16)
        self._records: dict[str, list[tuple[np.ndarray, np.ndarray]]] = {}  # (positions, ids)
        forward = runner._model_forward

        def recording_forward(*args: Any, **kwargs: Any) -> Any:
            self._step = [None] * len(self.layer_ids)
            output = forward(*args, **kwargs)
            self._record()
            return output

        runner._model_forward = recording_forward

    def _capture(self, index: int, topk_ids: torch.Tensor) -> None:
        self._step[index] = topk_ids

    def _record(self) -> None:
        runner = self._runner
        num_reqs = runner.input_batch.num_reqs
        if num_reqs == 0 or any(ids is None for ids in self._step):
            return  # a dummy or profiling forward
        starts = runner.query_start_loc.np[:num_reqs + 1].astype(np.int64)
        ids = np.stack([t[:starts[-1]].cpu().numpy() for t in self._step if t is not None], axis=1)
        ids = ids.astype(np.int16)  # [n, L, k]
        positions = runner.positions[:starts[-1]].cpu().numpy().astype(np.int64)
        for index, req_id in enumerate(runner.input_batch.req_ids[:num_reqs]):
            rows_of = slice(starts[index], starts[index + 1])
            pos, rows = positions[rows_of], ids[rows_of]
            if pos.size == 0:
                continue
            blocks = np.asarray(runner.requests[req_id].block_ids[0], dtype=np.int64)
            chunks = self._records.setdefault(req_id, [])
            if not chunks and pos[0] > 0:  # its first forward: the earlier ones were prefix-cached
                cached = np.arange(int(pos[0]))
                chunks.append((cached, self._slots[self._slot(blocks, cached)]))
            chunks.append((pos, rows))
            self._slots[self._slot(blocks, pos)] = rows

    def _slot(self, blocks: np.ndarray, positions: np.ndarray) -> np.ndarray:
        size = self._block_size
        return blocks[positions // size] * size + positions % size

    def take(self, external_id: str, num_tokens: int) -> bytes:
        """Pop the record of `external_id(-suffix)`: int16 bytes of [num_tokens, L, k]."""
        out = np.full((num_tokens, len(self.layer_ids), self.top_k), UNROUTED, np.int16)
        for req_id in [r for r in self._records
                       if r.rsplit("-", 1)[0] == external_id or r == external_id]:
            for pos, rows in self._records.pop(req_id):
                keep = pos < num_tokens
                out[pos[keep]] = rows[keep]
        return out.tobytes()


async def routed_experts(llm: Any, native: bool, shape: tuple[int, int], request_id: str,
                         final: Any, num_tokens: int) -> np.ndarray:
    """int16 [num_tokens, L, k] routed experts of a request ``final`` (vLLM's RequestOutput; None
    if aborted early), -1 where none: vLLM's own (``native``) or this module's record."""
    if not native:
        records = await llm.collective_rpc("molt_take_routing", args=(request_id, num_tokens))
        data = same_result(records)
        return np.frombuffer(data, dtype=np.int16).reshape(num_tokens, *shape)
    out = np.full((num_tokens, *shape), -1, dtype=np.int16)
    rows = final.outputs[0].routed_experts if final is not None and final.outputs else None
    if rows is not None:  # vLLM's rows cover every token but the last: [P + C - 1, L, k]
        out[:len(rows)] = rows[:num_tokens]
    return out


def same_result(results: list[Any],
                what: str = "returned different routing records for one request") -> Any:
    """The value every worker returned; RuntimeError ("vLLM workers ``what``") if they differ."""
    if any(result != results[0] for result in results[1:]):
        raise RuntimeError(f"vLLM workers {what}")
    return results[0]
