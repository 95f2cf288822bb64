"""An in-process transformers engine: the exact, seedable test double.

It decodes each request token by token with a KV cache, one forward at a time (requests
interleave between decode steps; nothing is batched), in fp32 by default:

    logp = log_softmax(logits / temperature)      # [V]; temperature 0: argmax, log_softmax(logits)
    token ~ Categorical(exp(logp)),  logprob = logp[token]

A model with multimodal RoPE (Qwen-VL) gets explicit position ids per request: the prompt's
(t, h, w) positions as the trainer computes them, then each token's cache position plus the
prompt's offset (max position + 1 - P); the model's own cached offset may be another request's.

A request samples from a generator seeded with derive_seed(its seed, else the engine's,
request_id): the same (seed, request_id) reproduces the same completion.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Sequence
from typing import Any

import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, PreTrainedModel

from molt.engines.base import Completion, Engine, SamplingParams, check_prompt
from molt.engines.refit import check_weights_file, read_adapter
from molt.models.layout import checkpoint_layout, checkpoint_shapes
from molt.models.images import VisionProcessor, mrope_positions
from molt.refit import PEFT_PREFIX, state_digests, tensor_digest
from molt.runtime.seeds import derive_seed

logger = logging.getLogger(__name__)


def eos_token_ids(model: PreTrainedModel) -> set[int]:
    ids: set[int] = set()
    for source in (getattr(model, "generation_config", None), model.config):
        value = getattr(source, "eos_token_id", None) if source is not None else None
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(int(v) for v in value)
    return ids


@dataclasses.dataclass
class _Request:
    """Decode state of one in-flight request."""

    prompt_token_ids: list[int]
    params: SamplingParams
    generator: torch.Generator
    past: Any = None
    vision_inputs: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)  # 1st forward
    rope: torch.Tensor | None = None  # [3, P] multimodal RoPE positions of the prompt (Qwen-VL)
    aborted: bool = False
    routing: list[torch.Tensor] = dataclasses.field(default_factory=list)  # [N, L, k] per forward
    completion: Completion = dataclasses.field(
        default_factory=lambda: Completion([], [], [], "length"))


class TransformersEngine(Engine):
    """A Hugging Face causal LM (a folder, hub id or built model) sampled in this process;
    ``record_routing``: record `Completion.routed_experts` (ValueError for a dense model);
    ``seed``: of requests that bring none (None: fresh randomness)."""

    def __init__(self, model: str | PreTrainedModel, *, dtype: torch.dtype = torch.float32,
                 device: str = "cpu", policy_version: int = 0, record_routing: bool = False,
                 seed: int | None = None) -> None:
        super().__init__()
        self.vision = VisionProcessor.of(model) if isinstance(model, str) else None
        self._checkpoint_shapes = checkpoint_shapes(model) if isinstance(model, str) else {}
        if isinstance(model, str):
            auto = AutoModelForImageTextToText if self.vision is not None else AutoModelForCausalLM
            model = auto.from_pretrained(model, dtype=dtype)
        self._rope_index = getattr(getattr(model, "model", None), "get_rope_index", None)
        self._model: PreTrainedModel | None = model.to(device).eval()  # type: ignore[arg-type]
        self._device = torch.device(device)
        self._eos_ids = eos_token_ids(model)
        self._version, self._seed = policy_version, seed
        self._requests: dict[str, _Request] = {}
        self._step_lock = asyncio.Lock()
        self._unpaused = asyncio.Event()
        self._unpaused.set()
        self.last_weight_digests: dict[str, str] = {}
        self._adapted = False  # LoRA layers injected (`load_adapter`)
        self._routed: list[torch.Tensor] = []  # the latest forward's top-k ids [N, k] per MoE layer
        self.routing_shape: tuple[int, int] | None = None
        if record_routing:
            from molt.train.moe import routers

            found = routers(model)
            if not found:
                raise ValueError("record_routing: the model has no mixture-of-experts router; "
                                 "hint: routing replay needs a MoE policy")
            self.routing_shape = (len(found), int(found[0].top_k))  # type: ignore[arg-type]
            for router in found:
                router.register_forward_hook(
                    lambda module, args, output: self._routed.append(output[2]))

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, images: Sequence[bytes] = ()) -> Completion:
        check_prompt(request_id, prompt_token_ids)
        self._check_open()
        if request_id in self._requests:
            raise ValueError(f"request id already in flight; got {request_id!r}; "
                             "hint: give every sample its own id, e.g. 'prompt/3'")
        request = _Request(list(prompt_token_ids), params, self._generator(request_id, params))
        if images or self.vision is not None:
            self._prepare_images(request, request_id, images)
        self._requests[request_id] = request
        try:
            completion = await self._decode_loop(request)
        finally:
            del self._requests[request_id]
        if self.routing_shape is not None:  # tokens never fed to a forward (the last) stay -1
            num_tokens = len(prompt_token_ids) + len(completion.token_ids)
            routed = torch.full((num_tokens, *self.routing_shape), -1, dtype=torch.int16)
            done = torch.cat(request.routing) if request.routing else routed[:0]
            routed[:len(done)] = done
            completion.routed_experts = routed.numpy()
        return completion

    def _prepare_images(self, request: _Request, request_id: str, images: Sequence[bytes]) -> None:
        if self.vision is None:
            raise ValueError(f"request {request_id!r}: {len(images)} image(s) for a text-only "
                             "model; hint: use a vision-language model")
        self.vision.check(request.prompt_token_ids, images, request_id)
        request.vision_inputs = self.vision.model_inputs(images) if images else {}
        if self._rope_index is not None:
            grids = request.vision_inputs.get("image_grid_thw", torch.zeros(0, 3, dtype=torch.long))
            request.rope = mrope_positions(self._rope_index, torch.tensor(request.prompt_token_ids),
                                           self.vision.image_token_id, grids)

    async def _decode_loop(self, request: _Request) -> Completion:
        completion = request.completion
        stop_ids = self._eos_ids | set(request.params.stop_token_ids)
        while True:
            await self._unpaused.wait()
            if request.aborted or self._model is None:
                completion.finish_reason = "abort"
                return completion
            async with self._step_lock:  # a weight load waits for the step in progress
                if not self._unpaused.is_set():  # paused while this request waited
                    continue
                token, logprob = await asyncio.to_thread(self._step, request)
                version = self._version
            completion.token_ids.append(token)
            completion.logprobs.append(logprob)
            completion.policy_versions.append(version)
            self.note_output()
            if token in stop_ids or len(completion.token_ids) >= request.params.max_new_tokens:
                completion.finish_reason = "stop" if token in stop_ids else "length"
                return completion

    @torch.inference_mode()
    def _step(self, request: _Request) -> tuple[int, float]:
        """One forward (the whole prompt first, then the last token) and one sample."""
        model = self._model
        assert model is not None, "closed engines end requests before stepping"
        new_ids = request.completion.token_ids[-1:] or request.prompt_token_ids
        input_ids = torch.tensor([new_ids], device=self._device)  # [1, N]
        kwargs: dict[str, Any] = {k: t.to(self._device) for k, t in request.vision_inputs.items()}
        request.vision_inputs = {}  # the images enter the first forward only
        if request.rope is not None:  # [4, 1, N]: cache positions over (t, h, w) positions
            num_prompt = len(request.prompt_token_ids)
            start = num_prompt + len(request.completion.token_ids) - len(new_ids)
            text = torch.arange(start, start + len(new_ids))[None]  # [1, N]
            rope = request.rope if start == 0 else text + (request.rope.max() + 1 - num_prompt)
            kwargs["position_ids"] = torch.cat([text, rope.expand(3, -1)])[:, None].to(self._device)
        self._routed = []
        out = model(input_ids=input_ids, past_key_values=request.past, use_cache=True, **kwargs)
        request.past = out.past_key_values
        if self._routed:
            routed = torch.stack(self._routed, dim=1)  # [N, L, k]
            request.routing.append(routed.to(torch.int16).cpu())
        logits = out.logits[0, -1].float()  # [V]
        return sample_token(logits, request.params, request.generator)

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        check_prompt("prompt_logprobs", token_ids)
        self._check_open()
        async with self._step_lock:  # not during a weight load
            return await asyncio.to_thread(self._prompt_logprobs, list(token_ids))

    @torch.inference_mode()
    def _prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        model = self._model
        assert model is not None, "checked open before"
        input_ids = torch.tensor([token_ids], device=self._device)  # [1, P]
        logits = model(input_ids=input_ids, use_cache=False).logits[0, :-1].float()  # [P-1, V]
        return torch.log_softmax(logits, -1).gather(-1, input_ids[0, 1:, None])[:, 0].tolist()

    def source_weight_digests(self) -> dict[str, str]:
        """Digests of the current weights, checkpoint-named and -laid-out as the trainer's."""
        from transformers.core_model_loading import revert_weight_conversion

        assert self._model is not None, "engine is closed"
        state = revert_weight_conversion(self._model, dict(self._model.state_dict()))
        return {name: tensor_digest(checkpoint_layout(t, self._checkpoint_shapes.get(name)))
                for name, t in state.items()}

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        generator = torch.Generator(device=self._device)
        seed = self._seed if params.seed is None else params.seed
        if seed is None:
            generator.seed()
        else:
            generator.manual_seed(derive_seed(seed, request_id))
        return generator

    async def pause(self) -> None:
        self._unpaused.clear()
        async with self._step_lock:
            pass

    async def resume(self) -> None:
        self._unpaused.set()

    async def abort(self, request_id: str) -> None:
        request = self._requests.get(request_id)
        if request is not None:
            request.aborted = True

    async def load_weights(self, path: str, version: int) -> None:
        """Requests in flight keep their KV cache and continue on the new weights, as on vLLM.

        Raises:
            ValueError: the file is missing, or does not cover the model's untied parameters.
        """
        self._check_open()
        check_weights_file(path)
        state = load_file(path)
        async with self._step_lock:
            await asyncio.to_thread(self._copy_weights, state)
            self._version = version
        self.last_weight_digests = state_digests(state)
        self.last_probe = None  # it described the previous weights
        logger.info("loaded weights version %d from %s", version, path)

    async def load_adapter(self, folder: str, version: int) -> None:
        """Inject peft's LoRA layers at the first load; copy the adapter into them.

        Raises:
            ValueError: not an adapter folder, or a tensor that names no adapter of the model.
        """
        from peft import LoraConfig, inject_adapter_in_model

        self._check_open()
        assert self._model is not None
        tensors, _ = read_adapter(folder)
        async with self._step_lock:
            if not self._adapted:
                inject_adapter_in_model(LoraConfig.from_pretrained(folder), self._model)
                self._adapted = True
            params = dict(self._model.named_parameters())
            names = {k: k.removeprefix(PEFT_PREFIX).replace(".weight", ".default.weight")
                     for k in tensors}
            if unknown := sorted(k for k, name in names.items() if name not in params):
                raise ValueError(f"adapter {folder}: {len(unknown)} tensors name no adapter of the "
                                 f"model, e.g. {unknown[:3]}; hint: the engine's model must be the "
                                 "trainer's base")
            with torch.no_grad():
                for k, name in names.items():
                    params[name].copy_(tensors[k])
            self._version = version
        self.last_weight_digests = state_digests(tensors)
        self.last_probe = None
        logger.info("loaded the adapter of version %d from %s", version, folder)

    def _copy_weights(self, state: dict[str, torch.Tensor]) -> None:
        """Load a checkpoint through transformers' loader (converting it as ``from_pretrained``
        does). Raises ValueError for unknown names, wrong shapes, or untied parameters it lacks."""
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import convert_and_load_state_dict_in_model
        from transformers.modeling_utils import LoadStateDictConfig

        model = self._model
        assert model is not None
        dtype = next(model.parameters()).dtype
        mapping: Any = get_model_conversion_mapping(model, None, None)  # converters and renamings
        config = LoadStateDictConfig(weight_mapping=mapping)
        state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
        info, _ = convert_and_load_state_dict_in_model(model, state, config)
        model.tie_weights()
        params = dict(model.named_parameters(remove_duplicate=False))
        loaded = {params[n].data_ptr() for n in params if n not in info.missing_keys}
        untied_missing = sorted(n for n in info.missing_keys
                                if n in params and params[n].data_ptr() not in loaded)
        bad = {"unexpected": sorted(info.unexpected_keys), "missing": untied_missing,
               "wrong shapes": sorted(info.mismatched_keys),
               "conversion errors": list(info.conversion_errors)}
        if any(bad.values()):
            shown = {k: v[:5] for k, v in bad.items() if v}
            raise ValueError(f"weights file does not match the model; got {shown}; "
                             "hint: export full HF-named weights of the same architecture")

    def close(self) -> None:
        """Drop the model; requests in flight end with finish_reason "abort"."""
        self._model = None
        self._unpaused.set()

    def _check_open(self) -> None:
        if self._model is None:
            raise RuntimeError("TransformersEngine is closed")


def sample_token(logits: torch.Tensor, params: SamplingParams,
                 generator: torch.Generator) -> tuple[int, float]:
    """(token id, its logprob as sampled) from fp32 logits [V]."""
    if params.greedy:
        logprobs = torch.log_softmax(logits, dim=-1)
        token = int(torch.argmax(logits))
    else:
        logprobs = torch.log_softmax(logits / params.temperature, dim=-1)
        token = int(torch.multinomial(logprobs.exp(), 1, generator=generator))
    return token, float(logprobs[token])
