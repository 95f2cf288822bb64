"""A LLaVA-style vision-language policy built from a text checkpoint and a small, fresh vision tower.

LLaVA (Liu et al. 2023, arXiv 2304.08485; LLaVA-1.5, arXiv 2310.03744) feeds an image
through a vision encoder, maps the patch features with a two-layer MLP projector
into the language model's embedding space and puts them where the prompt holds the
image placeholder tokens. Here:

- language model: any Llama/Mistral/Mixtral folder (the default or its upcycled MoE),
  weights copied unchanged; the tokenizer gains one special token ``<image>`` whose
  embedding row is the mean of the others (transformers' mean resizing);
- vision tower: a pretrained CLIP folder's (``vision_tower``, as LLaVA-1.5), or a fresh
  CLIP vision encoder (``CLIPVisionModel``) of ``vision_layers`` layers,
  width ``vision_hidden``, images ``image_size``^2 pixels cut into ``patch_size``^2
  patches: ``(image_size / patch_size)^2`` image tokens per image (16 by default; the
  CLS feature is dropped, LLaVA's "default" strategy). No pretrained vision weights
  can be downloaded here, so the tower is drawn from its initialiser with ``seed`` and
  learns in the supervised warm-up (``pipelines/sft.yaml``) with the projector;
- processor: ``LlavaProcessor`` with CLIP's PIL image processor (resize, centre crop,
  CLIP mean/std), which needs no torchvision.

The output is a normal Hugging Face folder (``LlavaForConditionalGeneration``) that
transformers and vLLM (``LlavaForConditionalGeneration``) both load, with
``molt-model.json`` naming the source and the vision settings.
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

IMAGE_TOKEN = "<image>"
PROVENANCE = "molt-model.json"
_LANGUAGE_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "MixtralForCausalLM")


def build_vlm(source: Path, out: Path, image_size: int = 64, patch_size: int = 16, vision_hidden: int = 256,
              vision_layers: int = 4, seed: int = 0, vision_tower: Path | None = None) -> Path:
    """Write the LLaVA-style VLM of the text folder ``source`` into the new folder ``out``.

    Args:
        source: a Hugging Face causal-LM folder (architectures ``LlamaForCausalLM``,
            ``MistralForCausalLM`` or ``MixtralForCausalLM``) with a chat template.
        out: a folder that must not exist yet; written atomically (temporary sibling, rename).
        image_size: side of the (square) processed image, pixels; a multiple of ``patch_size``.
        patch_size: side of one vision patch, pixels.
        vision_hidden: width of the vision tower (its MLP is 4x, heads of 64).
        vision_layers: transformer layers of the vision tower.
        seed: seed of the vision tower's and projector's initialisation.
        vision_tower: a pretrained CLIP folder (e.g. ``openai/clip-vit-large-patch14-336``, as
            LLaVA-1.5) whose vision weights, sizes and image processor replace the fresh tower
            (the four sizes above are then unused); None = a fresh tower.

    Returns:
        ``out``.

    Raises:
        ValueError: ``out`` exists, the sizes do not divide, or ``source`` is not a
            supported causal LM (naming its config.json and the field).
    """
    from transformers import (AutoModelForCausalLM, AutoTokenizer, CLIPVisionModel, LlavaConfig,
                              LlavaForConditionalGeneration)

    if out.exists():
        raise ValueError(f"build_vlm: the output folder exists; got {str(out)!r}; hint: choose a new folder")
    _check_language_model(source)
    tokenizer = AutoTokenizer.from_pretrained(source)
    tokenizer.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    text = AutoModelForCausalLM.from_pretrained(source, dtype="auto")
    text.resize_token_embeddings(len(tokenizer), mean_resizing=True)
    vision, images = _vision(image_size, patch_size, vision_hidden, vision_layers, vision_tower)
    image_tokens = (vision.image_size // vision.patch_size) ** 2
    config = LlavaConfig(vision_config=vision, text_config=text.config,
                         image_token_index=int(tokenizer.convert_tokens_to_ids(IMAGE_TOKEN)),  # type: ignore[arg-type]
                         vision_feature_select_strategy="default", vision_feature_layer=-1,
                         projector_hidden_act="gelu", image_seq_length=image_tokens,
                         tie_word_embeddings=text.config.tie_word_embeddings)
    torch.manual_seed(seed)
    vlm: Any = LlavaForConditionalGeneration(config)
    vlm.to(next(text.parameters()).dtype)
    with torch.no_grad():
        vlm.model.language_model.load_state_dict(text.model.state_dict(), strict=True)
        vlm.lm_head.weight.copy_(text.lm_head.weight)
        if vision_tower is not None:
            tower = CLIPVisionModel.from_pretrained(vision_tower, dtype=next(text.parameters()).dtype)
            vlm.model.vision_tower.load_state_dict(tower.state_dict(), strict=True)
    vlm.generation_config = text.generation_config
    provenance = {"vlm_from": str(source), "vision_tower": str(vision_tower) if vision_tower else None,
                  "image_size": vision.image_size, "patch_size": vision.patch_size,
                  "vision_hidden": vision.hidden_size, "vision_layers": vision.num_hidden_layers, "seed": seed,
                  "image_tokens": image_tokens}
    _save(vlm, tokenizer, images, provenance, out)
    logger.info("built the VLM %s from %s: %.1fM parameters (vision %.1fM), %d image tokens", out, source,
                sum(p.numel() for p in vlm.parameters()) / 1e6,
                sum(p.numel() for p in vlm.model.vision_tower.parameters()) / 1e6, image_tokens)
    return out


def _vision(image_size: int, patch_size: int, hidden: int, layers: int, pretrained: Path | None) -> tuple[Any, Any]:
    """(CLIPVisionConfig, PIL image processor): of the pretrained CLIP folder, or fresh ones of these sizes."""
    from transformers import CLIPVisionConfig
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    if pretrained is not None:
        return CLIPVisionConfig.from_pretrained(pretrained), CLIPImageProcessorPil.from_pretrained(pretrained)
    if image_size % patch_size or hidden % 64:
        raise ValueError(f"build_vlm: image_size must be a multiple of patch_size and vision_hidden of 64; got "
                         f"image_size {image_size}, patch_size {patch_size}, vision_hidden {hidden}")
    config = CLIPVisionConfig(hidden_size=hidden, intermediate_size=4 * hidden, num_hidden_layers=layers,
                              num_attention_heads=hidden // 64, image_size=image_size, patch_size=patch_size,
                              projection_dim=hidden)
    size = {"height": image_size, "width": image_size}
    return config, CLIPImageProcessorPil(size={"shortest_edge": image_size}, crop_size=size)


def _save(vlm: Any, tokenizer: Any, images: Any, provenance: dict[str, Any], out: Path) -> None:
    """Model, processor (LlavaProcessor: tokenizer + image processor) and provenance, atomically into ``out``."""
    from transformers import LlavaProcessor

    processor = LlavaProcessor(image_processor=images, tokenizer=tokenizer, patch_size=provenance["patch_size"],
                               vision_feature_select_strategy="default", image_token=IMAGE_TOKEN,
                               num_additional_image_tokens=1, chat_template=tokenizer.chat_template)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.partial-", dir=out.parent))
    try:
        vlm.save_pretrained(tmp)
        _vision_tower_names_for_vllm(tmp)
        processor.save_pretrained(tmp)
        (tmp / PROVENANCE).write_text(json.dumps(provenance, indent=1))
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def _vision_tower_names_for_vllm(folder: Path) -> None:
    """Rename ``vision_tower.X`` to ``vision_tower.vision_model.X`` in the folder's safetensors.

    transformers 5 saves a LLaVA's CLIP tower without the ``vision_model.`` level that
    llava-hf checkpoints have and vLLM's loader requires; it loads both layouts, and a
    model loaded from this one exports (``revert_weight_conversion``) under the same names,
    so refits need no renaming either.
    """
    from safetensors.torch import load_file, save_file

    for path in folder.glob("*.safetensors"):
        tensors = load_file(path)
        renamed = {("vision_tower.vision_model." + name.removeprefix("vision_tower.")
                    if name.startswith("vision_tower.") and not name.startswith("vision_tower.vision_model.")
                    else name): tensor for name, tensor in tensors.items()}
        save_file(renamed, path, metadata={"format": "pt"})


def _check_language_model(source: Path) -> None:
    path = source / "config.json"
    if not path.is_file():
        raise ValueError(f"build_vlm: no config.json in the source folder; got {str(source)!r}")
    architectures = json.loads(path.read_text()).get("architectures") or []
    if len(architectures) != 1 or architectures[0] not in _LANGUAGE_ARCHITECTURES:
        raise ValueError(f"build_vlm: {path}: architectures must be one of {list(_LANGUAGE_ARCHITECTURES)}; "
                         f"got {architectures}")
