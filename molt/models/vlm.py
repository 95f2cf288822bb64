"""A LLaVA-style vision-language policy: a text checkpoint plus a vision tower and projector.

LLaVA (Liu et al. 2023, arXiv 2304.08485; LLaVA-1.5, arXiv 2310.03744) encodes an image with a
vision tower, maps the patch features with a two-layer MLP projector into the language model's
embeddings, and puts them where the prompt holds the image's placeholder tokens. The language
model is copied unchanged, its tokenizer gains the token ``<image>`` (embedding: the mean of the
others); a fresh CLIP tower gives ``(image_size / patch_size)^2`` tokens per image (CLS dropped)
and learns with the projector in the supervised warm-up (``pipelines/sft.yaml``).
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from molt.models.layout import new_folder, source_config

logger = logging.getLogger(__name__)

IMAGE_TOKEN = "<image>"
_LANGUAGE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


def build_vlm(source: Path, out: Path, image_size: int = 64, patch_size: int = 16,
              vision_hidden: int = 256, vision_layers: int = 4, seed: int = 0,
              vision_tower: Path | None = None) -> Path:
    """Write the VLM of the text folder ``source`` into the new folder ``out``; return ``out``.
    Sizes are in pixels; a CLIP folder ``vision_tower`` replaces the fresh tower and its sizes.

    Raises:
        ValueError: ``out`` exists, the sizes do not divide, or ``source`` is not a supported
            causal LM.
    """
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPVisionModel, LlavaConfig,
                              LlavaForConditionalGeneration)

    _check_language_model(source, source_config(source, out, "build_vlm"))
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    text.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    vision, images = _vision(image_size, patch_size, vision_hidden, vision_layers, vision_tower)
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    image_token_id = int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN))  # type: ignore[arg-type]
    config = LlavaConfig(vision_config=vision, text_config=text.config,
                         image_token_index=image_token_id, vision_feature_select_strategy="default",
                         vision_feature_layer=-1, projector_hidden_act="gelu",
                         image_seq_length=image_tokens,
                         tie_word_embeddings=text.config.tie_word_embeddings)
    torch.manual_seed(seed)
    vlm: Any = LlavaForConditionalGeneration(config)
    dtype = next(text.parameters()).dtype
    vlm.to(dtype)
    with torch.no_grad():
        vlm.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
        vlm.lm_head.weight.copy_(text.lm_head.weight)
        if vision_tower is not None:
            tower = CLIPVisionModel.from_pretrained(vision_tower, dtype=dtype)
            vlm.model.vision_tower.load_state_dict(tower.state_dict(), strict=True)
    vlm.generation_config = text.generation_config
    provenance = {"vlm_from": str(source),
                  "vision_tower": str(vision_tower) if vision_tower else None,
                  "image_size": vision.image_size, "patch_size": vision.patch_size,
                  "vision_hidden": vision.hidden_size, "vision_layers": vision.num_hidden_layers,
                  "seed": seed, "image_tokens": image_tokens}
    _save(vlm, tokenizer, images, provenance, out)
    logger.info("built the VLM %s from %s: %.1fM parameters (vision %.1fM), %d image tokens", out,
                source, sum(p.numel() for p in vlm.parameters()) / 1e6,
                sum(p.numel() for p in vlm.model.vision_tower.parameters()) / 1e6, image_tokens)
    return out


def _vision(image_size: int, patch_size: int, hidden: int, layers: int,
            pretrained: Path | None) -> tuple[Any, Any]:
    """(CLIPVisionConfig, PIL image processor) of the pretrained CLIP folder, or fresh ones."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if pretrained is not None:
        return (CLIPVisionConfig.from_pretrained(pretrained),
                CLIPImageProcessorPil.from_pretrained(pretrained))
    if image_size % patch_size or hidden % 64:
        raise ValueError(f"build_vlm: image_size must be a multiple of patch_size and "
                         f"vision_hidden of 64; got image_size {image_size}, patch_size "
                         f"{patch_size}, vision_hidden {hidden}")
    config = CLIPVisionConfig(hidden_size=hidden, intermediate_size=4 * hidden,
                              num_hidden_layers=layers, num_attention_heads=hidden // 64,
                              image_size=image_size, patch_size=patch_size, projection_dim=hidden)
    size = {"height": image_size, "width": image_size}
    return config, CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=size)


def _save(vlm: Any, tokenizer: Any, images: Any, provenance: dict[str, Any], out: Path) -> None:
    from transformers import LlavaProcessor

    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer,
                               patch_size=provenance["patch_size"],
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    with new_folder(out, provenance) as tmp:
        vlm.save_pretrained(tmp)
        _vision_tower_names_for_vllm(tmp)
        processor.save_pretrained(tmp)


def _vision_tower_names_for_vllm(folder: Path) -> None:
    """Rename ``vision_tower.X`` to ``vision_tower.vision_model.X`` in the safetensors, as vLLM
    needs; transformers loads both and exports this one, so refits need no renaming."""
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower.")
                    if name.startswith("vision_tower.")
                    and not name.startswith("vision_tower.vision_model.")
                    else name): tensor for name, tensor in tensors.items()}
        save_file(renamed, path, metadata={"format": "pt"})


def _check_language_model(source: Path, config: dict[str, Any]) -> None:
    architectures = config.get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in _LANGUAGE_ARCHITECTURES:
        raise ValueError(f"build_vlm: {source / 'config.json'}: architectures must be one of "
                         f"{list(_LANGUAGE_ARCHITECTURES)}; got {architectures}")
