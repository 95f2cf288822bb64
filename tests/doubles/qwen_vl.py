"""A tiny random Qwen3-VL-MoE folder: the architecture of Qwen3-VL-30B-A3B at test size.

Text: 2 layers, hidden 128, heads of 64, 4 experts top-2 of width 48, stored in the
checkpoints' transposed layout (gate_up_proj [E, H, 2I], which differs from transformers'
in-memory [E, 2I, H] since 2I = 96 != H = 128),
multimodal RoPE sections (12, 10, 10). Vision: 2 blocks, patch 16, merge 2, deepstack
at block 0. Tokenizer: SmolLM2's with Qwen's four vision tokens added. Image processor:
transformers' Qwen2-VL PIL processor bounded to 64x64..64x96 px, so a 64x64 picture
is a (1, 4, 4) grid (4 tokens) and a 96x64 one (1, 4, 6) (6 tokens).
"""

from __future__ import annotations

import shutil
from pathlib import Path

import torch

VISION_TOKENS = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")


def build_tiny_qwen3_vl_moe(tokenizer_dir: Path, out: Path, seed: int = 0) -> Path:
    """Write the folder (model, tokenizer with chat template, preprocessor_config.json) to ``out``."""
    from transformers import AutoTokenizer, Qwen3VLMoeConfig, Qwen3VLMoeForConditionalGeneration
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.add_special_tokens({"additional_special_tokens": list(VISION_TOKENS)})
    ids = {token: int(tokenizer.convert_tokens_to_ids(token)) for token in VISION_TOKENS}
    text = {"vocab_size": len(tokenizer), "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 64, "moe_intermediate_size": 48,
            "num_experts": 4, "num_experts_per_tok": 2, "decoder_sparse_step": 1, "max_position_embeddings": 2048,
            "rope_parameters": {"rope_type": "default", "rope_theta": 5e6, "mrope_section": [12, 10, 10],
                                "mrope_interleaved": True},
            "bos_token_id": tokenizer.bos_token_id, "eos_token_id": tokenizer.eos_token_id,
            "pad_token_id": tokenizer.pad_token_id}
    vision = {"depth": 2, "hidden_size": 64, "intermediate_size": 128, "num_heads": 2, "patch_size": 16,
              "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 128,
              "num_position_embeddings": 64, "deepstack_visual_indexes": [0]}
    config = Qwen3VLMoeConfig(text_config=text, vision_config=vision, image_token_id=ids["<|image_pad|>"],
                              video_token_id=ids["<|video_pad|>"], vision_start_token_id=ids["<|vision_start|>"],
                              vision_end_token_id=ids["<|vision_end|>"], tie_word_embeddings=False)
    torch.manual_seed(seed)
    model = Qwen3VLMoeForConditionalGeneration(config)
    with torch.no_grad():  # the initialiser leaves routers at zero: every expert choice would tie
        for name, param in model.named_parameters():
            if name.endswith("mlp.gate.weight") or "experts" in name:
                param.normal_(0.0, 0.05)
    out.mkdir(parents=True)
    model.save_pretrained(out)
    _transpose_experts(out / "model.safetensors")
    tokenizer.save_pretrained(out)
    for name in ("chat_template.jinja",):
        if (tokenizer_dir / name).is_file():
            shutil.copy(tokenizer_dir / name, out / name)
    Qwen2VLImageProcessorPil(patch_size=16, merge_size=2, temporal_patch_size=2,
                             size={"shortest_edge": 64 * 64, "longest_edge": 64 * 96}).save_pretrained(out)
    return out


def _transpose_experts(path: Path) -> None:
    """Store the fused experts as Qwen3-VL-MoE's checkpoints do: gate_up_proj [E, H, 2I], down_proj [E, I, H]
    (transformers saves its in-memory [E, 2I, H] and [E, H, I]; it loads both)."""
    from safetensors.torch import load_file, save_file

    tensors = load_file(path)
    save_file({name: t.transpose(1, 2).contiguous() if "mlp.experts." in name else t for name, t in tensors.items()},
              path, metadata={"format": "pt"})
