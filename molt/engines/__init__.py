"""Inference engines behind one contract (`Engine`): `molt.engines.vllm.VLLMEngine` (production)
and `molt.engines.hf.TransformersEngine` (exact, seedable test double), imported on use."""

from __future__ import annotations

import logging
from typing import Any

from molt.engines.base import Completion, Engine, SamplingParams
from molt.engines.config import VLLM_ONLY, EngineConfig
from molt.refit import check_transport, engine_backend, rank_offset

__all__ = ["Completion", "Engine", "EngineConfig", "SamplingParams", "make_engine"]
logger = logging.getLogger(__name__)


def make_engine(config: EngineConfig, model_dir: str, where: str = "engine", replica: int = 0,
                seed: int = 0, live_versions: int = 1) -> Engine:
    """Start the configured engine on a local Hugging Face folder. ``where``: the YAML path of
    ``config``; ``replica``: the stage replica (its NCCL ranks); ``live_versions``: the most
    policy versions its requests in flight span (LoRA adapters served at once).

    Raises:
        ValueError: ``transport`` nccl without CUDA or with the transformers engine, or a model
            vLLM cannot serve here, naming the key.
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
            receiver = TransferReceiver(rank_offset(replica, workers), workers)
            transfer = WeightTransfer(backend, receiver)
        extra: dict[str, Any] = {}
        if config.block_size is not None:
            extra["block_size"] = config.block_size
        if config.tensor_parallel_size > 1:
            extra["tensor_parallel_size"] = config.tensor_parallel_size
        if config.enable_expert_parallel:
            extra["enable_expert_parallel"] = True
        return VLLMEngine(model_dir, dtype=config.dtype, seed=seed % 2**32,
                          max_model_len=config.max_model_len, kv_cache_gib=config.kv_cache_gib,
                          max_num_seqs=config.max_num_seqs, record_routing=config.record_routing,
                          weight_transfer=transfer, lora=served_adapters(config, model_dir, where),
                          max_loras=live_versions, engine_kwargs=extra)
    import torch

    from molt.engines.hf import TransformersEngine

    if config.transport.type != "shm":
        raise ValueError(f"{where}.transport.type: the transformers engine loads refits from files "
                         f"only; got {config.transport.type!r}; hint: use {{type: shm}}")
    defaults = EngineConfig.model_fields
    if ignored := sorted(k for k in VLLM_ONLY if getattr(config, k) != defaults[k].default):
        logger.warning("%s: %s set but ignored by the transformers engine (vLLM only)", where,
                       ", ".join(ignored))
    return TransformersEngine(model_dir, dtype=getattr(torch, config.dtype),
                              record_routing=config.record_routing, seed=seed)
