"""Sparse upcycling: a dense Llama-style checkpoint -> a Mixtral-style MoE that computes the same function.

Sparse upcycling (Komatsuzaki et al. 2022, arXiv 2212.05055) starts a mixture of
experts from a dense model: every decoder layer's MLP is copied into each of E
experts and a fresh router is added. Mixtral's block (Jiang et al. 2024,
arXiv 2401.04088) with router weights W_r [E, H] computes, per token x [H]:

    p = softmax(W_r x)                 # [E], in fp32
    S = top-k indices of p;  w_i = p_i / sum_{j in S} p_j
    y = sum_{i in S} w_i * expert_i(x)

With expert_i = the dense MLP for every i, y = MLP(x) * sum w_i = MLP(x): the
upcycled model's logits equal the dense model's up to rounding (measured on
SmolLM2-135M, E 4, top-2: max |diff| about 1e-4), whatever the router. Training
then separates the experts, since each receives the gradient of its own tokens.

Attention, norms and embeddings keep their names (Llama and Mixtral share them);
``model.layers.N.mlp.{gate,up,down}_proj`` become transformers' fused
``mlp.experts.gate_up_proj [E, 2I, H]`` (gate rows first) and
``mlp.experts.down_proj [E, H, I]``, saved by ``save_pretrained`` per expert
(``block_sparse_moe.experts.N.w1/w2/w3``), the layout vLLM loads. The router is
drawn from N(0, initializer_range^2) with ``seed``. The output is a normal Hugging
Face folder (config, safetensors, tokenizer and chat template copied from the source,
``molt-model.json`` naming the source, E, k and the seed).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

_SHARED_CONFIG = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "hidden_act", "max_position_embeddings", "initializer_range",
                  "rms_norm_eps", "pad_token_id", "bos_token_id", "eos_token_id", "tie_word_embeddings",
                  "rope_parameters", "attention_dropout")
PROVENANCE = "molt-model.json"
_NOT_COPIED = ("*.safetensors", "*.bin", "*.pt", "*.index.json", "config.json", PROVENANCE)


def upcycle(source: Path, out: Path, num_experts: int = 4, top_k: int = 2, seed: int = 0) -> Path:
    """Write the upcycled MoE of the dense folder ``source`` into the new folder ``out``.

    Args:
        source: a Hugging Face folder of a Llama-style causal LM without biases
            (``LlamaForCausalLM``/``MistralForCausalLM``: SwiGLU MLP ``gate/up/down_proj``).
        out: a folder that must not exist yet; written atomically (a temporary sibling,
            then one rename).
        num_experts: E >= 2 copies of each MLP.
        top_k: experts per token, 1 <= k <= E.
        seed: seed of the router initialisation.

    Returns:
        ``out``.

    Raises:
        ValueError: ``out`` exists, E or k out of range, or ``source``'s config.json
            names another architecture or biases (naming the field).
    """
    from transformers import AutoModelForCausalLM, MixtralConfig, MixtralForCausalLM

    if out.exists():
        raise ValueError(f"upcycle: the output folder exists; got {str(out)!r}; hint: choose a new folder")
    if num_experts < 2 or not 1 <= top_k <= num_experts:
        raise ValueError(f"upcycle: need experts >= 2 and 1 <= top_k <= experts; got experts {num_experts}, "
                         f"top_k {top_k}")
    dense_config = _check_dense(source)
    shared = {k: dense_config[k] for k in _SHARED_CONFIG if k in dense_config}
    config = MixtralConfig(**shared, num_local_experts=num_experts, num_experts_per_tok=top_k,
                           sliding_window=None, dtype=dense_config.get("dtype") or dense_config.get("torch_dtype"))
    dense = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    moe: Any = MixtralForCausalLM(config)
    moe.to(next(dense.parameters()).dtype)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        _copy_weights(dense, moe, config.initializer_range, generator)
    moe.generation_config = dense.generation_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        for item in source.iterdir():  # tokenizer, chat template, generation config
            if item.is_file() and not any(item.match(pattern) for pattern in _NOT_COPIED):
                shutil.copy2(item, tmp / item.name)
        moe.save_pretrained(tmp)
        provenance = {"upcycled_from": str(source), "num_experts": num_experts, "top_k": top_k, "seed": seed}
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("upcycled %s into %s: %d experts, top-%d, %.1fM parameters", source, out, num_experts, top_k,
                sum(p.numel() for p in moe.parameters()) / 1e6)
    return out


def _check_dense(source: Path) -> dict[str, Any]:
    """The source's config.json as a dict, if it is an upcyclable dense model."""
    path = source / "config.json"
    if not path.is_file():
        raise ValueError(f"upcycle: no config.json in the source folder; got {str(source)!r}")
    config = json.loads(path.read_text())
    architectures = config.get("architectures") or []
    if architectures not in (["LlamaForCausalLM"], ["MistralForCausalLM"]):
        raise ValueError(f"upcycle: {path}: architectures must be ['LlamaForCausalLM'] or ['MistralForCausalLM'] "
                         f"(SwiGLU MLP, no biases); got {architectures}")
    for key in ("attention_bias", "mlp_bias"):
        if config.get(key):
            raise ValueError(f"upcycle: {path}: {key} is true; Mixtral layers have no biases")
    return config


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
        raise ValueError(f"upcycle: the dense checkpoint has no tensors for {sorted(moe_params.keys() - done)[:3]}")
