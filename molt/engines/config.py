"""Engine selection from YAML: ``engine: {type: vllm, dtype: float32, ...}``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from molt.policy import LoraConfig, Precision, policy_field
from molt.refit import ShmTransport, TransportConfig

VLLM_ONLY = {"kv_cache_gib", "max_num_seqs", "block_size", "tensor_parallel_size",
             "enable_expert_parallel", "serve_adapters"}


class EngineConfig(BaseModel):
    """Which engine runs the policy and how it is sized."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["vllm", "transformers"] = Field(
        "vllm", description="transformers: exact, slow, unbatched; the test double, and the CPU "
        "engine of models vLLM's CPU build cannot serve (Qwen-VL); vLLM-only keys are then ignored")
    dtype: Precision = policy_field("precision", "float32",
                                    description="sampling precision (policy.precision)")
    max_model_len: int = Field(2048, ge=16, description="context window (tokens)")
    kv_cache_gib: float = Field(2.0, gt=0, description="vLLM KV cache size (GiB)")
    max_num_seqs: int = Field(256, ge=1, description="vLLM sequences decoded at once")
    block_size: int | None = Field(
        None, ge=16, multiple_of=16,
        description="vLLM KV-cache block (tokens; None: vLLM's default; a multiple of 32 on CPU); "
                    "only full blocks are prefix-cached, so a group shares its prompt's full ones")
    record_routing: bool = Field(
        False, description="MoE: record the experts each token was routed to, as the column "
        "routed_experts (routing replay)")
    tensor_parallel_size: int = Field(1, ge=1,
                                      description="vLLM: GPUs one engine shards each layer over")
    enable_expert_parallel: bool = Field(
        False, description="vLLM: shard a MoE's experts over the engine's GPUs, not each expert")
    lora: LoraConfig | None = policy_field("lora", description="policy.lora; vLLM then serves each "
                                           "version's adapter (molt.engines.vllm_lora)")
    serve_adapters: bool | None = Field(
        None, description="vLLM: serve a LoRA policy's adapters, one per live version; false: "
        "merge each into the weights, a full refit; None: serve on GPUs, merge on CPU")
    transport: TransportConfig = Field(
        default_factory=ShmTransport, description="how refits arrive: {type: shm} (files) or "
        "{type: nccl} (CUDA; must match the trainer's publish transport; molt.refit)")
