"""The framework-owned generation loop: one rollout of an :class:`Env`, token-exact.

Each turn: 1) the engine generates from the current token ids; its ids, logprobs
and versions are appended untouched (``loss_mask`` true); 2) the decoded text goes
to ``env.step``; 3) unless the episode ended, the env's reply is appended as
chat-template delta tokens (``loss_mask`` false, ``policy_version`` -1). If the
template cannot extend the sequence (it rewrites earlier turns), the rollout starts
a new *segment* from a fresh render of the whole conversation; segments share the
rollout's reward.

Tools (an env with ``tools``, molt.agents.tools): a turn in which the chat template's tool
parser finds calls is not the env's: the framework runs the calls (each in a worker thread)
and appends their results as ``tool`` messages (``loss_mask`` false); a turn without calls
(plain text, or a malformed call, which is counted and passed on as the text it is) goes to
``env.step``, and so does a last turn (``max_turns``) that calls tools. ``info`` counts
``tool_calls``, ``malformed_tool_calls`` and ``tool_turns`` (turns parsed).

Budgets: ``max_turns`` policy turns and ``max_total_tokens`` per segment (the
context window): a turn gets ``min(max_new_tokens, budget left)`` new tokens and an
episode with no budget left ends as truncated (finish_reason ``length``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from molt.agents.base import AgentError, Env, Message, Result
from molt.agents.chat import ChatTemplate
from molt.agents.tools import ParsedTurn, Tool, run_tool
from molt.engines.base import Completion, Engine, SamplingParams


@dataclasses.dataclass
class Segment:
    """Per-token lists of one row, all of length T; ``routed_experts`` int16 [T, L, k] or None;
    ``images`` the encoded images whose tokens the row holds, in order, and
    ``image_token_id`` the id of their tokens (molt.models.images; None for a text-only model).

    Routing (when the engine records it): each turn's completion covers the whole
    sequence so far (prompt, earlier turns, env tokens, its own tokens); a position keeps
    the experts of the first turn that routed it, so a token's record is the routing of
    the forward that first processed it (later turns reuse it through the prefix cache);
    env tokens appended after the last turn stay -1 (never routed).
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_version: list[int] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None
    images: list[bytes] = dataclasses.field(default_factory=list)
    image_token_id: int | None = None

    def extend_context(self, ids: list[int], images: list[bytes] | None = None) -> None:
        """Append prompt, tool or env tokens (not trained on) and the images among them."""
        self.images += images or []
        self.token_ids += ids
        self.loss_mask += [False] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.policy_version += [-1] * len(ids)

    def extend_generated(self, out: Completion) -> None:
        """Append the engine's tokens, logprobs and versions untouched (trained on), and merge its routing.

        Raises:
            ValueError: the completion's routing does not cover exactly the sequence so far.
        """
        self.token_ids += out.token_ids
        self.loss_mask += [True] * len(out.token_ids)
        self.rollout_logprobs += out.logprobs
        self.policy_version += out.policy_versions
        if out.routed_experts is None:
            return
        if len(out.routed_experts) != len(self.token_ids):
            raise ValueError(f"the engine's routed_experts cover {len(out.routed_experts)} tokens, the sequence "
                             f"has {len(self.token_ids)}")
        merged = np.array(out.routed_experts, dtype=np.int16)
        if self.routed_experts is not None:
            kept = self.routed_experts[:len(merged)]
            merged[:len(kept)] = np.where(kept >= 0, kept, merged[:len(kept)])
        self.routed_experts = merged

    def row(self) -> dict[str, Any]:
        """The per-token columns of this segment, ``images`` and ``image_token_positions`` (null without
        images), with ``routed_experts`` (int16 bytes of [T, L, k],
        -1 where no forward routed, env tokens after the last turn included) when recorded."""
        row: dict[str, Any] = {"token_ids": self.token_ids, "loss_mask": self.loss_mask,
                               "rollout_logprobs": self.rollout_logprobs, "policy_version": self.policy_version}
        if self.routed_experts is not None:
            routed = np.full((len(self.token_ids), *self.routed_experts.shape[1:]), -1, np.int16)
            routed[:len(self.routed_experts)] = self.routed_experts
            row["routed_experts"] = routed.tobytes()
        row["images"] = self.images or None  # null without images
        row["image_token_positions"] = [i for i, t in enumerate(self.token_ids)
                                        if t == self.image_token_id] if self.images else None
        return row


@dataclasses.dataclass
class Episode:
    """One finished rollout: its segments, score and diagnostics."""

    segments: list[Segment]
    score: float | None
    finish_reason: str
    num_turns: int
    completion_text: str
    info: dict[str, Any]

    def tool_metrics(self) -> dict[str, float]:
        """Its tool figures (`count_tool_calls`): ``tool/calls`` and ``tool/malformed_frac`` (the share of its parsed
        turns holding a malformed call); {} for an episode without tools."""
        turns = self.info.get("tool_turns", 0)
        return {"tool/calls": self.info["tool_calls"],
                "tool/malformed_frac": self.info["malformed_tool_calls"] / turns} if turns else {}


async def run_episode(engine: Engine, chat: ChatTemplate, env: Env, task: dict[str, Any],
                      params: SamplingParams, request_id: str, max_turns: int = 1,
                      max_total_tokens: int = 2048) -> Episode:
    """Run one rollout of ``env`` on ``task`` (see the module docstring).

    Raises:
        ValueError: the opening prompt is empty or does not fit ``max_total_tokens``, or a VLM
            policy generated its image token (molt.models.images).
        AgentError: ``env.reset`` or ``env.step`` raised (the caller counts the failure).
    """
    messages: list[Message] = list(_call_env(env.reset, task, request_id))
    env_tools = getattr(env, "tools", ())  # an env need not subclass Env
    tools, schemas = {t.name: t for t in env_tools}, [t.schema() for t in env_tools]
    seg = Segment(image_token_id=chat.image_token_id)
    seg.extend_context(chat.prompt_ids(messages, schemas), chat.images(messages))
    if not 0 < len(seg.token_ids) < max_total_tokens:
        raise ValueError(f"request {request_id}: prompt has {len(seg.token_ids)} tokens; the context "
                         f"window (max_total_tokens) is {max_total_tokens}; hint: shorten the prompt")
    segments, score, finish, text, turns = [seg], None, "length", "", 0
    info: dict[str, Any] = {}
    for turns in range(1, max_turns + 1):
        budget = min(params.max_new_tokens, max_total_tokens - len(seg.token_ids))
        if budget <= 0:
            finish = "length"
            break
        out = await engine.generate(f"{request_id}/t{turns}", seg.token_ids,
                                    dataclasses.replace(params, max_new_tokens=budget), seg.images)
        if chat.image_token_id is not None and chat.image_token_id in out.token_ids:
            raise ValueError(f"request {request_id}: the policy generated its image token (id {chat.image_token_id}), "
                             "which no image fills and no forward can take; the rollout counts as failed")
        seg.extend_generated(out)
        text = chat.decode(out.token_ids)
        parsed = chat.tool_parser.parse(text, f"call_{turns}") if tools and out.finish_reason != "abort" else None
        count_tool_calls(info, parsed)
        if parsed and parsed.calls and turns < max_turns:  # the framework runs the calls; results are the next input
            call, *new = await _tool_turn(parsed, tools)
            messages.append(call)
        else:
            messages.append({"role": "assistant", "content": text})
            result = _call_env(env.step, text, request_id)
            score, finish, info = result.reward, out.finish_reason, {**info, **result.info}
            if result.terminated or result.truncated or out.finish_reason == "abort" or turns == max_turns:
                ended = result.terminated or result.truncated or out.finish_reason == "abort"
                finish = "length" if result.truncated or not ended else finish
                if not ended:
                    info["cut_by_max_turns"] = True
                break
            new = _observation(result, request_id)
        try:
            delta = chat.turn_delta_ids(messages, new, out.finish_reason == "stop", schemas)
            seg.extend_context(delta, chat.images(new))
        except ValueError:  # the template rewrote earlier turns: continue in a new segment
            seg = Segment(image_token_id=chat.image_token_id)
            seg.extend_context(chat.prompt_ids([*messages, *new], schemas), chat.images([*messages, *new]))
            segments.append(seg)
        messages += new
    return Episode(segments, score, finish, turns, text, info)


async def _tool_turn(parsed: ParsedTurn, tools: dict[str, Tool]) -> list[Message]:
    """The assistant message of a turn that calls tools, then the calls' results (each run in a worker thread)."""
    results = [await asyncio.to_thread(run_tool, tools, c) for c in parsed.calls]
    return [{"role": "assistant", "content": parsed.content, "tool_calls": [c.openai() for c in parsed.calls]},
            *({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": result}
              for c, result in zip(parsed.calls, results))]


def _observation(result: Result, request_id: str) -> list[Message]:
    """The env's reply as the next messages (a string: a user message); raises AgentError for none."""
    if result.observation is None:
        raise AgentError(f"request {request_id}: env.step returned no observation without ending the "
                         "episode; hint: set terminated=True or give the next message")
    return [result.observation if isinstance(result.observation, dict)
            else {"role": "user", "content": str(result.observation)}]


def count_tool_calls(info: dict[str, Any], parsed: ParsedTurn | None) -> None:
    """Count a turn's tool calls and malformed calls in an episode's ``info`` (``tool_calls``, ``malformed_tool_calls``,
    ``tool_turns``: turns parsed for calls); nothing for a turn not parsed (None)."""
    if parsed is not None:
        counts = {"tool_turns": 1, "tool_calls": len(parsed.calls), "malformed_tool_calls": int(bool(parsed.malformed))}
        for key, n in counts.items():
            info[key] = info.get(key, 0) + n


def _call_env(method: Any, arg: Any, request_id: str) -> Any:
    try:
        return method(arg)
    except Exception as e:  # noqa: BLE001 - any env failure is this rollout's, not the stage's
        raise AgentError(f"request {request_id}: {type(e).__name__} in env.{method.__name__}: {e}") from e


def episode_rows(ep: Episode, prompt_id: str, rollout_id: str, task: dict[str, Any], group_size: int,
                 with_score: bool) -> list[dict[str, Any]]:
    """Trajectory rows (molt.schema columns), one per segment, of a finished rollout.

    ``metadata`` holds the task's fields plus ``completion_text`` (the last turn,
    decoded, for graders), ``num_turns`` and ``env_info``; ``score`` is included
    when the env grades (``with_score``).
    """
    meta = json.dumps({**task, "completion_text": ep.completion_text, "num_turns": ep.num_turns,
                       "env_info": ep.info})
    rows = []
    for s, seg in enumerate(ep.segments):
        row = {"sample_id": f"{rollout_id}/{s}", "prompt_id": prompt_id, "rollout_id": rollout_id,
               "segment_index": s, **seg.row(), "group_size": group_size,
               "finish_reason": ep.finish_reason, "metadata": meta}
        if with_score:
            row["score"] = ep.score
        rows.append(row)
    return rows


async def run_group(episode: Callable[[str], Awaitable[Episode]], prompt_id: str, task: dict[str, Any],
                    index: int, group_size: int,
                    with_score: bool) -> tuple[list[dict[str, Any]], list[tuple[str, Exception]]]:
    """Run the ``group_size`` rollouts of one prompt concurrently (``episode(rollout_id)``).

    Rollout ids are ``{prompt_id}#{index}/{k}`` (``index``: the group's admission
    number, so ids never repeat). Returns the rows of the rollouts that finished
    (`episode_rows`) and ``(rollout_id, error)`` of those that failed with an
    :class:`AgentError` or ``ValueError`` (e.g. a prompt over the context window).

    Raises:
        BaseException: any other error of a rollout (an engine failure fails the stage).
    """
    ids = [f"{prompt_id}#{index}/{k}" for k in range(group_size)]
    results = await asyncio.gather(*(episode(rid) for rid in ids), return_exceptions=True)
    rows: list[dict[str, Any]] = []
    failed: list[tuple[str, Exception]] = []
    for rid, ep in zip(ids, results):
        if isinstance(ep, (AgentError, ValueError)):
            failed.append((rid, ep))
        elif isinstance(ep, BaseException):
            raise ep
        else:
            rows += episode_rows(ep, prompt_id, rid, task, group_size, with_score)
    return rows, failed
