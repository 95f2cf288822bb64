"""Sparse upcycling: a dense Llama-style checkpoint -> a Mixtral-style MoE of the same function.

Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055) copies every layer's MLP into each
of E experts and adds a fresh router. Mixtral's block (Jiang et al. 2024, arXiv 2401.04088) with
router weights W_r [E, H] computes, per token x [H]:

    p = softmax(W_r x)                 # [E], in fp32
    S = top-k indices of p;  w_i = p_i / sum_{j in S} p_j
    y = sum_{i in S} w_i * expert_i(x)

With every expert_i the dense MLP, y = MLP(x) * sum w_i = MLP(x): the logits equal the dense
model's up to rounding, whatever the router; training then separates the experts. Routers ~
N(0, initializer_range^2), drawn with ``seed``.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch

from molt.models.layout import PROVENANCE, new_folder, source_config

logger = logging.getLogger(__name__)

_SHARED_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                  "num_attention_heads", "num_key_value_heads", "head_dim", "hidden_act",
                  "max_position_embeddings", "initializer_range", "rms_norm_eps", "pad_token_id",
                  "bos_token_id", "eos_token_id", "tie_word_embeddings", "rope_parameters",
                  "attention_dropout")
_NOT_COPIED = ("*.safetensors", "*.bin", "*.pt", "*.index.json", "config.json", PROVENANCE)


def upcycle(source: Path, out: Path, num_experts: int = 4, top_k: int = 2, seed: int = 0) -> Path:
    """Write the upcycled MoE of the dense folder ``source`` (Llama or Mistral, no biases), with
    its tokenizer and chat template, into the new folder ``out``; return ``out``.

    Raises:
        ValueError: ``out`` exists, E < 2, k not in 1..E, or ``source``'s config.json names
            another architecture or biases.
    """
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    if num_experts < 2 or not 1 <= top_k <= num_experts:
        raise ValueError(f"upcycle: need experts >= 2 and 1 <= top_k <= experts; got experts "
                         f"{num_experts}, top_k {top_k}")
    dense_config = source_config(source, out, "upcycle")
    _check_dense(source / "config.json", dense_config)
    shared = {k: dense_config[k] for k in _SHARED_CONFIG if k in dense_config}
    config = MixtralConfig(**shared, num_local_experts=num_experts, num_experts_per_tok=top_k,
                           sliding_window=None,
                           dtype=dense_config.get("dtype") or dense_config.get("torch_dtype"))
    dense = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    moe: Any = MixtralForCausalLM(config)
    moe.to(next(dense.parameters()).dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _copy_weights(dense, moe, config.initializer_range, generator)
    moe.generation_config = dense.generation_config
    provenance = {"upcycled_from": str(source), "num_experts": num_experts, "top_k": top_k,
                  "seed": seed}
    with new_folder(out, provenance) as tmp:
        for item in source.iterdir():  # tokenizer, chat template, generation config
            if item.is_file() and not any(item.match(pattern) for pattern in _NOT_COPIED):
                shutil.copy2(item, tmp / item.name)
        moe.save_pretrained(tmp)
    logger.info("upcycled %s into %s: %d experts, top-%d, %.1fM parameters", source, out,
                num_experts, top_k, sum(p.numel() for p in moe.parameters()) / 1e6)
    return out


def _check_dense(path: Path, config: dict[str, Any]) -> None:
    architectures = config.get("architectures") or []
    if architectures not in (["LlamaForCausalLM"], ["MistralForCausalLM"]):
        raise ValueError(f"upcycle: {path}: architectures must be ['LlamaForCausalLM'] or "
                         f"['MistralForCausalLM'] (SwiGLU MLP, no biases); got {architectures}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"upcycle: {path}: {key} is true; Mixtral layers have no biases")


def _copy_weights(dense: Any, moe: Any, std: float, generator: torch.Generator) -> None:
    """Shared tensors by name; each MLP into every expert; routers ~ N(0, std^2)."""
    moe_params = dict(moe.named_parameters())
    done = set()
    for name, tensor in dense.state_dict().items():
        if ".mlp." not in name and name in moe_params:
            moe_params[name].copy_(tensor)
            done.add(name)
    for dense_layer, moe_layer in zip(dense.model.layers, moe.model.layers):
        mlp, block = dense_layer.mlp, moe_layer.mlp
        gate_up = torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])  # [2I, H]
        block.experts.gate_up_proj.copy_(gate_up.expand_as(block.experts.gate_up_proj))
        block.experts.down_proj.copy_(mlp.down_proj.weight.expand_as(block.experts.down_proj))
        router = block.gate.weight
        router.copy_(torch.randn(router.shape, generator=generator) * std)
    done |= {name for name in moe_params if ".mlp." in name}
    if moe_params.keys() - done:
        missing = sorted(moe_params.keys() - done)[:3]
        raise ValueError(f"upcycle: the dense checkpoint has no tensors for {missing}")
