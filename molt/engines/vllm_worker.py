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
"""

from __future__ import annotations

import logging
import time

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
        weights = iter_weights(path, digests) if digest else iter_weights(path, None)
        self.reload_weights(  # type: ignore[attr-defined]
            weights_iterator=weights, is_checkpoint_format=True)
        seconds = time.perf_counter() - start
        logger.info("molt: reloaded weights from %s in %.2f s", path, seconds)
        return {"digests": digests, "seconds": seconds}
