"""LoRA adapters on vLLM, one per live policy version: what makes an adapter-only refit exact.

The engine keeps its base weights and serves version v as adapter id v + 1. A request keeps the
adapter current at its submission to its end, so all its tokens carry that version; a refit
never pauses generation. Under a staleness bound s the requests in flight span at most s + 1
versions: ``max_loras = s + 1`` slots. Where vLLM cannot serve adapters (`served_adapters`),
each is merged into the base weights, a full refit: the "merge fallback" (`load_merged`).
"""

from __future__ import annotations

import asyncio
import logging
import shutil
from collections import Counter
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt.engines.refit import file_digests, merged_checkpoint, read_adapter
from molt.refit import ADAPTER_FILE, state_digests
from molt.runtime.stage import scratch_folder

if TYPE_CHECKING:
    from vllm.lora.request import LoRARequest
    from vllm.v1.engine.async_llm import AsyncLLM

    from molt.engines.config import EngineConfig
    from molt.policy import LoraConfig

logger = logging.getLogger(__name__)
VLLM_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # vLLM's allowed max_lora_rank values


def engine_kwargs(lora: LoraConfig, max_loras: int) -> dict[str, Any]:
    """vLLM's arguments for ``lora``'s adapters, ``max_loras`` in one batch; ValueError for a
    rank above vLLM's largest."""
    rank = next((r for r in VLLM_RANKS if r >= lora.rank), None)
    if rank is None:
        raise ValueError(f"lora.rank: vLLM serves adapters up to rank {VLLM_RANKS[-1]}; "
                         f"got {lora.rank}")
    # only the targets: vLLM otherwise also wraps the output head, whose LoRA path fails a batch
    # holding a prompt-logprobs request (the refit probe) beside another one
    return {"enable_lora": True, "max_lora_rank": rank, "max_loras": max_loras,
            "max_cpu_loras": max_loras + 1, "lora_target_modules": list(lora.target_modules)}


def served_adapters(config: EngineConfig, model_dir: str, where: str) -> LoraConfig | None:
    """``config.lora`` where a vLLM engine of ``config`` (YAML key ``where``) serves adapters:
    ``serve_adapters`` says so (None: on GPUs), refits arrive as files, and vLLM's class for the
    model supports LoRA; otherwise None (the merge fallback)."""
    from vllm import ModelRegistry
    from vllm.model_executor.models.interfaces import supports_lora
    from vllm.platforms import current_platform
    from vllm.plugins import load_general_plugins

    from molt.engines.vllm_plugin import architectures

    serve = config.serve_adapters
    if serve is None:
        serve = not current_platform.is_cpu()
    if config.lora is None or not serve or config.transport.type != "shm":
        if config.lora is not None:
            logger.log(logging.WARNING if config.serve_adapters else logging.INFO,
                       "%s: each LoRA adapter refit is loaded as full weights (serve_adapters %s, "
                       "transport %s)", where, config.serve_adapters, config.transport.type)
        return None
    load_general_plugins()  # as vLLM does before it imports a model class
    # the first registered architecture; vLLM's Transformers backend serves the others, with LoRA
    known = [ModelRegistry.models[a] for a in architectures(model_dir) if a in ModelRegistry.models]
    if known and not supports_lora(known[0].load_model_cls()):
        logger.warning("%s: vLLM's class for %s serves no LoRA adapters; each adapter refit is "
                       "merged into the weights (the merge fallback, molt.engines.vllm_lora)",
                       where, model_dir)
        return None
    return config.lora


async def load_merged(load_weights: Callable[[str, int], Awaitable[None]], model_dir: Path,
                      folder: str, version: int) -> dict[str, str]:
    """The merge fallback: ``load_weights`` ``model_dir``'s weights with the adapter in ``folder``
    merged as version ``version``; the digests of the adapter's tensors as read and merged."""
    from safetensors.torch import save_file

    adapter, scaling = await asyncio.to_thread(read_adapter, folder)
    digests = await asyncio.to_thread(state_digests, adapter)
    state = await asyncio.to_thread(merged_checkpoint, model_dir, adapter, scaling)
    path = scratch_folder("molt-merged-")  # removed by the runner even if this process is killed
    try:
        await asyncio.to_thread(save_file, state, str(path / "model.safetensors"))
        await load_weights(str(path / "model.safetensors"), version)
    finally:
        shutil.rmtree(path, ignore_errors=True)
    return digests


class Adapters:

    def __init__(self) -> None:
        self.folder = scratch_folder("molt-adapters-")
        self.requests: dict[int, LoRARequest] = {}  # version -> vLLM's handle of its adapter
        self.users: Counter[int] = Counter()  # version -> requests in flight on its adapter

    async def add(self, llm: AsyncLLM, source: str, version: int) -> dict[str, str]:
        """Load the adapter folder ``source`` into every worker; the digest of each tensor as vLLM
        reads it (from the engine's own copy). RuntimeError if vLLM did not load it."""
        from vllm.lora.request import LoRARequest

        dest = self.folder / f"v{version}"
        shutil.rmtree(dest, ignore_errors=True)
        await asyncio.to_thread(shutil.copytree, source, dest)
        digests = await asyncio.to_thread(file_digests, str(dest / ADAPTER_FILE))
        request = LoRARequest(f"molt-v{version}", version + 1, str(dest))
        if not await llm.add_lora(request):
            raise RuntimeError(f"vLLM did not load the adapter of version {version} ({source})")
        self.requests[version] = request
        return digests

    def take(self, version: int) -> LoRARequest | None:
        """The adapter of ``version`` for a new request (None: the base weights)."""
        if (request := self.requests.get(version)) is not None:
            self.users[version] += 1
        return request

    def release(self, version: int) -> None:
        self.users[version] -= 1

    async def retire(self, llm: AsyncLLM, newest: int) -> None:
        """Unload every adapter older than ``newest`` that no request in flight uses."""
        for version in [v for v in self.requests if v < newest and self.users[v] <= 0]:
            if (request := self.requests.pop(version, None)) is None:  # a concurrent retire took it
                continue
            self.users.pop(version, None)
            await llm.remove_lora(request.lora_int_id)
            shutil.rmtree(self.folder / f"v{version}", ignore_errors=True)

    def close(self) -> None:
        shutil.rmtree(self.folder, ignore_errors=True)
