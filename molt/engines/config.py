"""Engine selection from YAML: ``engine: {type: vllm, dtype: float32, ...}``."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from molt.policy import LoraConfig, Precision, policy_field
from molt.refit import ShmTransport, TransportConfig

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
