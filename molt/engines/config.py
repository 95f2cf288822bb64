"""Engine selection from YAML: ``engine: {type: vllm, dtype: float32, ...}``."""

from __future__ import annotations

import logging
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from molt.engines.base import Engine
from molt.policy import LoraConfig, Precision, policy_field
from molt.refit import ShmTransport, TransportConfig, check_transport, engine_backend, rank_offset


logger = logging.getLogger(__name__)
VLLM_ONLY = {"kv_cache_gib", "max_num_seqs", "block_size", "tensor_parallel_size", "enable_expert_parallel",
             "serve_adapters"}


class EngineConfig(BaseModel):
    """Which engine runs the policy and how it is sized."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["vllm", "transformers"] = Field(
        "vllm", description="transformers: exact and slow, one request step at a time; the test double, and the "
        "CPU engine of models vLLM's CPU build cannot serve (Qwen-VL); vLLM-only keys are then ignored")
    dtype: Precision = policy_field("precision", "float32", description="sampling precision (molt.policy: "
                                    "policy.precision); fp32 matches an fp32 trainer to ~1e-5")
    max_model_len: int = Field(2048, ge=16, description="context window (tokens)")
    kv_cache_gib: float = Field(2.0, gt=0, description="vLLM KV cache size (GiB)")
    max_num_seqs: int = Field(256, ge=1, description="vLLM sequences decoded at once")
    block_size: int | None = Field(
        None, ge=16, multiple_of=16,
        description="vLLM KV-cache block (tokens; None = vLLM's default, 128 on CPU, where it must be a "
                    "multiple of 32). Only full blocks are prefix-cached, so the samples of a group share "
                    "the prefill of the blocks their prompt fills completely (32: 1 of a 46-token prompt).")
    record_routing: bool = Field(
        False, description="MoE: record the experts the engine routed every token to, as the column "
        "routed_experts (routing replay; molt.engines.vllm_routing)")
    tensor_parallel_size: int = Field(1, ge=1, description="vLLM: GPUs one engine shards each layer over")
    enable_expert_parallel: bool = Field(False, description="vLLM: shard a MoE's experts over the engine's GPUs "
                                         "instead of slicing each expert (vLLM's expert parallelism)")
    lora: LoraConfig | None = policy_field("lora", description="molt.policy: policy.lora; vLLM then serves each "
                                           "version's adapter (molt.engines.vllm_lora)")
    serve_adapters: bool | None = Field(
        None, description="vLLM: serve a LoRA policy's adapters, one per live version (molt.engines.vllm_lora); "
        "false: merge each into the weights, a full refit; None: serve on GPUs, merge on CPU, where vLLM's LoRA "
        "kernels halved generation (77 against 155 tokens/s, 135M default, 32 requests)")
    transport: TransportConfig = Field(
        default_factory=ShmTransport, description="how refits arrive: {type: shm} (files) or {type: nccl} "
        "(vLLM's weight-transfer API; CUDA; the trainer's publish transport must match; molt.refit)")


def make_engine(config: EngineConfig, model_dir: str, where: str = "engine", replica: int = 0,
                seed: int = 0, live_versions: int = 1) -> Engine:
    """Start the configured engine on a local Hugging Face folder; ``where`` is the YAML path of
    ``config`` (for errors), ``replica`` the stage replica (its NCCL ranks, for ``transport: nccl``),
    ``seed`` its sampling seed (vLLM's engine-wide seed, its low 32 bits as numpy's seeding takes;
    the transformers engine's per-request generators; molt.seeds), ``live_versions`` the most policy
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
