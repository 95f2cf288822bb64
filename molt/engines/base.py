"""The engine contract: prompt token ids in; sampled token ids, their logprobs and versions out.

Each token records the logprob it was sampled with, `log_softmax(logits / temperature)[token]`,
which the trainer recomputes (greedy, temperature 0: `log_softmax(logits)[token]`); top-p and
top-k would renormalise and break that equality, so they are refused. C = generated tokens.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Literal, TypeVar

import numpy as np

FinishReason = Literal["stop", "length", "abort"]
T = TypeVar("T")
_RENORM = ("renormalises, so the recorded logprob would not match the trainer's "
           "log_softmax(logits / temperature)")


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample one completion; ``stop_token_ids`` end it (included), beside the model's eos
    ids; ``seed``: None for fresh randomness (vLLM ignores it, with a warning)."""

    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0  # only 1.0 (module docstring)
    top_k: int = 0  # only 0, off
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    seed: int | None = None

    def __post_init__(self) -> None:
        """Raises ValueError for top_p < 1, top_k > 0, or a value out of range."""
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if self.temperature < 0:
            raise ValueError(f"sampling temperature must be >= 0; got {self.temperature}; "
                             "hint: use 0 for greedy decoding")
        if self.top_p != 1.0:
            raise ValueError(f"sampling top_p must be 1.0; got {self.top_p}; hint: top-p "
                             f"{_RENORM}; lower the temperature instead")
        if self.top_k != 0:
            raise ValueError(f"sampling top_k must be 0 (off); got {self.top_k}; hint: top-k "
                             f"{_RENORM}")
        if self.max_new_tokens < 1:
            raise ValueError(f"sampling max_new_tokens must be >= 1; got {self.max_new_tokens}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclasses.dataclass
class Completion:
    """One sampled completion, aligned token by token. ``routed_experts``: int16 [P + C, L, k]
    experts each token was routed to (L MoE layers, top-k), -1 where none (always the last
    token); None unless the engine records routing."""

    token_ids: list[int]  # [C], including a final stop/eos token
    logprobs: list[float]  # [C] as sampled (after temperature)
    policy_versions: list[int]  # [C] of the weights that produced each token
    finish_reason: FinishReason  # stop: eos or a stop id; length: max_new_tokens; abort
    routed_experts: np.ndarray | None = None

    def __post_init__(self) -> None:
        num_tokens = len(self.token_ids)
        if len(self.logprobs) != num_tokens or len(self.policy_versions) != num_tokens:
            raise ValueError("completion lists must have one entry per token; got "
                             f"{num_tokens} token_ids, {len(self.logprobs)} logprobs, "
                             f"{len(self.policy_versions)} policy_versions")


def check_prompt(request_id: str, prompt_token_ids: list[int]) -> None:
    """Raises ValueError for an empty prompt, which no causal LM can condition on."""
    if not prompt_token_ids:
        raise ValueError(f"request {request_id!r}: prompt_token_ids is empty; hint: "
                         "prompts include at least a BOS or chat-template token")


class EngineDeadError(RuntimeError):
    """The engine's process died, or it hung and was `Engine.kill`ed: all its work fails with it."""


class Engine(abc.ABC):
    """An inference engine: async (many `generate` calls in flight on one event loop),
    token-in/token-out, with live weight loads.

    `load_weights(path, version)` applies new weights between two decode steps: completions in
    flight continue on them, their later tokens carrying the new version, and no prefix-cache
    entry of older weights is reused.

    `generate` and other work handed to `tracked` (a refit) is in flight. `last_output_s` is
    stamped when a piece ends, when work reaches an idle engine, and at each `note_output`.
    `kill` kills the engine's processes and fails all work in flight with `EngineDeadError`; so
    does the first death any work meets, since the rest may never hear of it (vLLM leaves an RPC
    to a dead engine core waiting for ever).
    """

    dead_errors: tuple[type[Exception], ...] = (EngineDeadError,)  # what work meets on a death

    def __init__(self) -> None:
        self.last_output_s = time.monotonic()  # time.monotonic() of the last output
        self.killed: str | None = None  # why the engine is dead (`kill`); None while alive
        self._tasks_in_flight: set[asyncio.Task[Any]] = set()  # the tasks awaiting `tracked` work
        self._cancelled: set[asyncio.Task[Any]] = set()  # those `kill` cancelled

    async def generate(self, request_id: str, prompt_token_ids: list[int],
                       params: SamplingParams, images: Sequence[bytes] = ()) -> Completion:
        """Sample one completion of `prompt_token_ids` [P]; ``images``: the PNG/JPEG bytes of a
        vision-language prompt, whose image tokens it holds as the model's forward sees them.

        Raises:
            ValueError: an empty prompt, a request id already in flight, or image tokens that do
                not match ``images`` (or images for a text-only engine).
            EngineDeadError: the engine died or was killed, before or while the request ran.
            RuntimeError: the engine is closed.
        """
        return await self.tracked(
            f"request {request_id!r}",
            lambda: self._generate(request_id, prompt_token_ids, params, images))

    async def tracked(self, what: str, work: Callable[[], Awaitable[T]]) -> T:
        """``await work()`` in flight on this engine; EngineDeadError naming ``what`` if it dies."""
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
            if killed_here := task in self._cancelled:  # kill's cancel: the engine's death
                task.uncancel()
            if isinstance(error, self.dead_errors) and self.killed is None:  # the rest must hear it
                self.kill(f"the engine died: {self.describe_death(error)}")
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
        """`generate` without the bookkeeping."""

    @property
    def num_in_flight(self) -> int:
        return len(self._tasks_in_flight)

    def note_output(self) -> None:
        self.last_output_s = time.monotonic()

    def stalled_s(self) -> float:
        """Seconds a busy engine has gone without an output; 0.0 when idle."""
        return time.monotonic() - self.last_output_s if self._tasks_in_flight else 0.0

    def kill(self, why: str) -> None:
        """Make the engine dead (class docstring), naming ``why``."""
        self.killed = why
        try:
            self._kill_processes()
        finally:
            self._cancelled = self._tasks_in_flight - {asyncio.current_task()}
            for task in self._cancelled:
                task.cancel()

    def _kill_processes(self) -> None:
        """SIGKILL the engine's processes, stopped ones too."""

    def describe_death(self, error: Exception) -> str:
        """What ended the engine, ``error`` being what work in flight met."""
        return str(error)

    @abc.abstractmethod
    async def pause(self) -> None:
        """Stop scheduling decode steps; requests stay queued until `resume`."""

    @abc.abstractmethod
    async def resume(self) -> None:
        """Resume decode steps after `pause`."""

    @abc.abstractmethod
    async def load_weights(self, path: str, version: int) -> None:
        """Load full HF-named weights from a safetensors file; later tokens carry `version`."""

    async def load_adapter(self, folder: str, version: int) -> None:
        """Take as ``version`` the starting weights with the peft adapter in ``folder`` applied;
        `last_weight_digests` are the adapter's. Raises ValueError here."""
        raise ValueError(f"weight record v{version} is a LoRA adapter ({folder}), but "
                         f"{type(self).__name__} takes full weights only; hint: train without "
                         "lora, or use a vLLM or transformers engine")

    @property
    def streams_weights(self) -> bool:
        """True when refits come streamed (`receive_weights`): the trainer waits for every one."""
        return False

    async def receive_weights(self, record: dict[str, Any]) -> None:
        """As `load_weights`, for a weight record whose ``format`` is not a file (e.g. "nccl").
        Raises ValueError here."""
        raise ValueError(f"weight record v{record['policy_version']} comes over "
                         f"{record['format']!r}, but {type(self).__name__} loads files only; hint: "
                         "publish with transport "
                         "{type: shm} (molt.train.publish)")

    @abc.abstractmethod
    async def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """[P-1] ``log_softmax(logits(token_ids[:t]))[token_ids[t]]``, t = 1..P-1: raw, under the
        current weights, never from a prefix cache (the refit probe, molt.refit)."""

    def source_weight_digests(self) -> dict[str, str]:
        """name -> `tensor_digest` of the weights the engine started from ({} if unknown)."""
        return {}

    @abc.abstractmethod
    async def abort(self, request_id: str) -> None:
        """End a request early (finish_reason "abort"); an unknown one is ignored."""

    _version: int = 0  # set by subclasses at construction and by load_weights
    # name -> tensor_digest of each tensor the last load consumed ({} before any)
    last_weight_digests: dict[str, str]
    # (probe token ids, this engine's prompt_logprobs of them) after the last verified refit
    last_probe: tuple[list[int], list[float]] | None = None

    @property
    def policy_version(self) -> int:
        return self._version

    @abc.abstractmethod
    def close(self) -> None:
        """Release the engine's model and processes; idempotent."""
