"""The framework-owned generation loop: one rollout of an :class:`Env`, token-exact.

Each turn: 1) the engine generates from the token ids so far (appended untouched,
``loss_mask`` true); 2) the env's tools run the turn's parsed calls or, for a turn without
calls or the last of ``max_turns``, ``env.step`` runs; 3) unless the episode ended, the results
or reply are appended as chat-template delta tokens (``loss_mask`` false, ``policy_version``
-1), or a new *segment* starts if the template rewrites earlier turns. A turn gets at most
``max_total_tokens`` minus the tokens so far; with none left the episode ends with ``length``.
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
    """Per-token lists of one row, all of length T; ``routed_experts`` int16 [T, L, k] or None.

    A position keeps the experts of the first forward that routed it (later turns reuse it
    through the prefix cache); env tokens after the last turn stay -1.
    """

    token_ids: list[int] = dataclasses.field(default_factory=list)
    loss_mask: list[bool] = dataclasses.field(default_factory=list)
    rollout_logprobs: list[float] = dataclasses.field(default_factory=list)
    policy_version: list[int] = dataclasses.field(default_factory=list)
    routed_experts: np.ndarray | None = None
    images: list[bytes] = dataclasses.field(default_factory=list)
    image_token_id: int | None = None

    def extend_context(self, ids: list[int], images: list[bytes] | None = None) -> None:
        """Append prompt, tool or env tokens (not trained on) and their images."""
        self.images += images or []
        self.token_ids += ids
        self.loss_mask += [False] * len(ids)
        self.rollout_logprobs += [0.0] * len(ids)
        self.policy_version += [-1] * len(ids)

    def extend_generated(self, out: Completion) -> None:
        """Append the engine's tokens, logprobs and versions (trained on); merge its routing.

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
            raise ValueError(f"the engine's routed_experts cover {len(out.routed_experts)} tokens, "
                             f"the sequence has {len(self.token_ids)}")
        merged = np.array(out.routed_experts, dtype=np.int16)
        if self.routed_experts is not None:
            kept = self.routed_experts[:len(merged)]
            merged[:len(kept)] = np.where(kept >= 0, kept, merged[:len(kept)])
        self.routed_experts = merged

    def row(self) -> dict[str, Any]:
        """The segment's columns; ``routed_experts`` (int16 bytes) only when recorded."""
        row: dict[str, Any] = {"token_ids": self.token_ids, "loss_mask": self.loss_mask,
                               "rollout_logprobs": self.rollout_logprobs,
                               "policy_version": self.policy_version}
        if self.routed_experts is not None:
            routed = np.full((len(self.token_ids), *self.routed_experts.shape[1:]), -1, np.int16)
            routed[:len(self.routed_experts)] = self.routed_experts
            row["routed_experts"] = routed.tobytes()
        row["images"] = self.images or None
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
        """``tool/calls`` and ``tool/malformed_frac`` (of parsed turns); {} without tools."""
        turns = self.info.get("tool_turns", 0)
        return {"tool/calls": self.info["tool_calls"],
                "tool/malformed_frac": self.info["malformed_tool_calls"] / turns} if turns else {}


async def run_episode(engine: Engine, chat: ChatTemplate, env: Env, task: dict[str, Any],
                      params: SamplingParams, request_id: str, max_turns: int = 1,
                      max_total_tokens: int = 2048) -> Episode:
    """Run one rollout of ``env`` on ``task``.

    Raises:
        ValueError: the prompt is empty or over ``max_total_tokens``; a VLM's image token generated.
        AgentError: ``env.reset`` or ``env.step`` raised.
    """
    messages: list[Message] = list(_call_env(env.reset, task, request_id))
    env_tools = getattr(env, "tools", ())  # an env need not subclass Env
    tools, schemas = {t.name: t for t in env_tools}, [t.schema() for t in env_tools]
    seg = Segment(image_token_id=chat.image_token_id)
    seg.extend_context(chat.prompt_ids(messages, schemas), chat.images(messages))
    if not 0 < len(seg.token_ids) < max_total_tokens:
        raise ValueError(f"request {request_id}: prompt has {len(seg.token_ids)} tokens; the "
                         f"context window (max_total_tokens) is {max_total_tokens}; hint: shorten "
                         "the prompt")
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
            raise ValueError(f"request {request_id}: the policy generated its image token (id "
                             f"{chat.image_token_id}), which no image fills and no forward can "
                             "take; the rollout counts as failed")
        seg.extend_generated(out)
        text = chat.decode(out.token_ids)
        parsed = (chat.tool_parser.parse(text, f"call_{turns}")
                  if tools and out.finish_reason != "abort" else None)
        count_tool_calls(info, parsed)
        if parsed and parsed.calls and turns < max_turns:
            call, *new = await _tool_turn(parsed, tools)
            messages.append(call)
        else:
            messages.append({"role": "assistant", "content": text})
            result = _call_env(env.step, text, request_id)
            score, finish, info = result.reward, out.finish_reason, {**info, **result.info}
            ended = result.terminated or result.truncated or out.finish_reason == "abort"
            if ended or turns == max_turns:
                finish = "length" if result.truncated or not ended else finish
                if not ended:
                    info["cut_by_max_turns"] = True
                break
            new = _observation(result, request_id)
        try:
            delta = chat.turn_delta_ids(messages, new, out.finish_reason == "stop", schemas)
            seg.extend_context(delta, chat.images(new))
        except ValueError:  # the template rewrote earlier turns
            seg = Segment(image_token_id=chat.image_token_id)
            every = [*messages, *new]
            seg.extend_context(chat.prompt_ids(every, schemas), chat.images(every))
            segments.append(seg)
        messages += new
    return Episode(segments, score, finish, turns, text, info)


async def _tool_turn(parsed: ParsedTurn, tools: dict[str, Tool]) -> list[Message]:
    """The assistant message of a turn that calls tools, then the calls' results."""
    results = [await asyncio.to_thread(run_tool, tools, c) for c in parsed.calls]
    return [{"role": "assistant", "content": parsed.content,
             "tool_calls": [c.openai() for c in parsed.calls]},
            *({"role": "tool", "tool_call_id": c.id, "name": c.name, "content": result}
              for c, result in zip(parsed.calls, results))]


def _observation(result: Result, request_id: str) -> list[Message]:
    """The env's reply as the next messages.

    Raises:
        AgentError: no observation.
    """
    if result.observation is None:
        raise AgentError(f"request {request_id}: env.step returned no observation without ending "
                         "the episode; hint: set terminated=True or give the next message")
    return [result.observation if isinstance(result.observation, dict)
            else {"role": "user", "content": str(result.observation)}]


def count_tool_calls(info: dict[str, Any], parsed: ParsedTurn | None) -> None:
    """Count a parsed turn in ``info``: ``tool_turns``, ``tool_calls``, ``malformed_tool_calls``;
    ``malformed_tool_call`` keeps the last malformed call's reason."""
    if parsed is not None:
        counts = {"tool_turns": 1, "tool_calls": len(parsed.calls),
                  "malformed_tool_calls": int(bool(parsed.malformed))}
        for key, n in counts.items():
            info[key] = info.get(key, 0) + n
        if parsed.malformed:
            info["malformed_tool_call"] = parsed.malformed


def _call_env(method: Any, arg: Any, request_id: str) -> Any:
    try:
        return method(arg)
    except Exception as e:  # noqa: BLE001 - any env failure is this rollout's, not the stage's
        raise AgentError(f"request {request_id}: {type(e).__name__} in env.{method.__name__}: "
                         f"{e}") from e


def episode_rows(ep: Episode, prompt_id: str, rollout_id: str, task: dict[str, Any],
                 group_size: int, with_score: bool) -> list[dict[str, Any]]:
    """Trajectory rows (molt.schema), one per segment; ``metadata`` adds ``completion_text``
    (the last turn), ``num_turns`` and ``env_info`` to the task."""
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


async def run_group(episode: Callable[[str], Awaitable[Episode]], prompt_id: str,
                    task: dict[str, Any], index: int, group_size: int, with_score: bool
                    ) -> tuple[list[dict[str, Any]], list[tuple[str, Exception]]]:
    """Run rollouts ``{prompt_id}#{index}/{k}`` concurrently: the finished ones' rows and
    ``(rollout_id, error)`` of those that raised AgentError or ValueError.

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
