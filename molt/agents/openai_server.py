"""ChatAgent: user code drives a rollout with the stock OpenAI SDK; tokens stay exact.

The rollout serves ``/v1/chat/completions`` on loopback, one base URL per rollout. A request
whose messages extend the conversation so far is rendered as a template delta; any other
starts a new *segment* (segments share one reward). The reply is the decoded text or, with
``tools``, the parsed ``tool_calls``. Sampling is the rollout's: a request that would change it
(temperature, ``n``, a forced ``tool_choice``, an option neither `_APPLIED` nor `_OFF`) or
exceed ``max_turns`` gets HTTP 400, so what the agent sees is what is recorded.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import dataclasses
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from molt.agents.base import AgentError, Message
from molt.agents.chat import ChatTemplate
from molt.agents.episode import Episode, Segment, count_tool_calls
from molt.engines.base import Engine, EngineDeadError, SamplingParams


class ChatAgent(abc.ABC):
    """An agent written against the OpenAI SDK; a new instance runs each rollout in a worker
    thread, so blocking ``openai.OpenAI`` code works."""

    @abc.abstractmethod
    def run(self, client: Any, task: dict[str, Any]) -> float | None:
        """Drive one rollout of ``task`` with ``client`` (an ``openai.OpenAI``); return its
        reward, or None to let a reward stage grade the last reply."""


@dataclasses.dataclass
class ChatSession:
    """The token record of one rollout served over HTTP."""

    rollout_id: str
    segments: list[Segment] = dataclasses.field(default_factory=list)
    messages: list[Message] = dataclasses.field(default_factory=list)
    finish_reason: str = "length"
    turns: int = 0
    last_text: str = ""
    usage: dict[str, int] = dataclasses.field(default_factory=dict)
    tools: list[dict[str, Any]] = dataclasses.field(default_factory=list)  # the segment's
    info: dict[str, Any] = dataclasses.field(default_factory=dict)  # tool-call counts
    engine_dead: EngineDeadError | None = None


class ChatServer:
    """The loopback OpenAI-compatible endpoint of a rollout stage."""

    def __init__(self, engine: Engine, chat: ChatTemplate, params: SamplingParams,
                 max_turns: int, max_total_tokens: int, max_agents: int = 64) -> None:
        self.engine, self.chat, self.params = engine, chat, params
        self.max_turns, self.max_total_tokens = max_turns, max_total_tokens
        self.sessions: dict[str, ChatSession] = {}
        self.executor = ThreadPoolExecutor(max_workers=max_agents, thread_name_prefix="chat_agent")
        self.port = 0
        self._runner: web.AppRunner | None = None
        self._started: asyncio.Future[None] | None = None

    async def start(self, host: str = "127.0.0.1") -> None:
        app = web.Application()
        app.router.add_post("/r/{rid}/v1/chat/completions", self._handle)
        self._runner = web.AppRunner(app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, 0)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        """Stop serving (idempotent)."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        self.close()

    def close(self) -> None:
        """Stop taking agent work (idempotent); running agents finish."""
        self.executor.shutdown(wait=False, cancel_futures=True)

    async def run_episode(self, agent: ChatAgent, task: dict[str, Any], rollout_id: str) -> Episode:
        """Run ``agent`` on ``task`` as rollout ``rollout_id``.

        Raises:
            AgentError: the agent raised (an HTTP 400 it received included).
            EngineDeadError: the engine died serving it (the agent got HTTP 503).
        """
        import openai

        self._started = self._started or asyncio.ensure_future(self.start())
        await self._started
        key = uuid.uuid4().hex  # rollout ids hold '#' and '/'
        self.sessions[key] = ChatSession(rollout_id)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{self.port}/r/{key}/v1", api_key="molt",
                               max_retries=0)
        loop = asyncio.get_running_loop()
        try:
            reward = await loop.run_in_executor(self.executor, agent.run, client, task)
        except Exception as e:  # noqa: BLE001 - the agent's failure is this rollout's
            raise AgentError(f"rollout {rollout_id}: {type(e).__name__} in "
                             f"{type(agent).__name__}.run: {e}") from e
        finally:
            session = self.sessions.pop(key)
            client.close()
            if session.engine_dead is not None:  # the agent's error was the engine's death
                raise session.engine_dead
        if not session.segments:
            raise AgentError(f"rollout {rollout_id}: the agent made no chat completion request")
        return Episode(session.segments, reward, session.finish_reason, session.turns,
                       session.last_text, session.info)

    async def _handle(self, request: web.Request) -> web.Response:
        session = self.sessions.get(request.match_info["rid"])
        if session is None:
            return _error(404, f"no rollout {request.match_info['rid']!r} is running")
        body = await request.json()
        problem = self._check(session, body)
        if problem:
            return _error(400, problem)
        try:
            messages = [_message(m) for m in body["messages"]]
            message, finish = await self._turn(
                session, messages, body.get("tools") or [], body.get("tool_choice") != "none",
                body.get("max_tokens") or body.get("max_completion_tokens"))
        except EngineDeadError as error:  # the rollout restarts the engine and the group
            session.engine_dead = error
            return _error(503, f"the engine died: {error}")
        except ValueError as error:  # the opening prompt does not fit
            return _error(400, str(error))
        return web.json_response({
            "id": f"molt-{session.rollout_id}-{session.turns}", "object": "chat.completion",
            "created": 0, "model": body.get("model", "molt"), "usage": session.usage,
            "choices": [{"index": 0, "finish_reason": finish, "logprobs": None,
                         "message": message}]})

    def _check(self, session: ChatSession, body: dict[str, Any]) -> str:
        if session.turns >= self.max_turns:
            return f"turn budget exhausted: max_turns is {self.max_turns}"
        if body.get("n") not in (None, 1):
            return (f"n must be 1; got {body['n']}; hint: the rollout stage samples group_size "
                    "rollouts itself")
        t = body.get("temperature")
        if t is not None and t != self.params.temperature:
            return (f"temperature {t} differs from the rollout's {self.params.temperature}; hint: "
                    "leave it unset, or set the pipeline's policy.temperature")
        unsupported = sorted(k for k, v in body.items() if k not in _APPLIED and not _is_off(k, v))
        if unsupported:
            return (f"unsupported options {unsupported} (only these are applied: "
                    f"{sorted(_APPLIED)}; these are accepted when off: {_OFF}); the rollout "
                    f"samples with temperature {self.params.temperature} and records exactly that; "
                    "hint: leave them unset")
        if body.get("tool_choice") not in (None, "auto", "none"):
            return (f"tool_choice {body['tool_choice']!r} is not supported: forcing a call needs "
                    "constrained decoding, which samples from another distribution than the "
                    "policy's; hint: leave it unset (auto)")
        return _malformed(body)

    async def _turn(self, session: ChatSession, messages: list[Message],
                    tools: list[dict[str, Any]], parse: bool,
                    max_tokens: int | None) -> tuple[Message, str]:
        # 1) extend the segment by a template delta, or start a new one (also when tools change)
        known = session.messages
        delta: list[int] | None = None
        extends = (tools == session.tools and messages[:len(known)] == known
                   and len(messages) > len(known))
        if session.segments and extends:
            with contextlib.suppress(ValueError):  # the template rewrote earlier turns
                delta = self.chat.turn_delta_ids(known, messages[len(known):],
                                                 session.finish_reason == "stop", tools)
        seg = Segment() if delta is None else session.segments[-1]
        context = self.chat.prompt_ids(messages, tools) if delta is None else delta
        # 2) generate from the exact ids, within the turn's and the context's budget
        budget = min(self.params.max_new_tokens, max_tokens or self.params.max_new_tokens,
                     self.max_total_tokens - len(seg.token_ids) - len(context))
        if budget <= 0 and not session.segments:
            raise ValueError(f"the prompt ({len(context)} tokens) fills the context window of "
                             f"{self.max_total_tokens}")
        session.turns += 1
        if budget <= 0:  # the context is full: end the turn as the engine would, recording nothing
            session.last_text, session.finish_reason = "", "length"
            session.messages = [*messages, {"role": "assistant", "content": ""}]
            return session.messages[-1], "length"
        if delta is None:
            session.segments.append(seg)
        session.tools = tools
        seg.extend_context(context)
        out = await self.engine.generate(f"{session.rollout_id}/t{session.turns}", seg.token_ids,
                                         dataclasses.replace(self.params, max_new_tokens=budget))
        prompt, completion = len(seg.token_ids), len(out.token_ids)
        session.usage = {"prompt_tokens": prompt, "completion_tokens": completion,
                         "total_tokens": prompt + completion}
        seg.extend_generated(out)
        # 3) answer with the decoded text or the calls in it; remember the conversation it ends
        text, session.finish_reason = self.chat.decode(out.token_ids), out.finish_reason
        parsed = (self.chat.tool_parser.parse(text, f"call_{session.turns}")
                  if tools and parse else None)
        count_tool_calls(session.info, parsed)
        message: Message = {"role": "assistant", "content": text}
        finish: str = out.finish_reason
        if parsed is not None and parsed.calls:
            message = {**message, "content": parsed.content,
                       "tool_calls": [c.openai() for c in parsed.calls]}
            finish = "tool_calls" if finish == "stop" else finish
        elif parsed is not None and parsed.malformed and finish == "stop":
            finish = "malformed_tool_call"
        session.last_text = message["content"] or ""  # graders read the text, not the calls
        session.messages = [*messages, _message(message)]
        return message, finish


# Request keys the server applies; any other is refused unless None or one of its "off" values.
_APPLIED = frozenset({"messages", "model", "max_tokens", "max_completion_tokens", "temperature",
                      "n", "user", "tools", "tool_choice"})
_OFF: dict[str, tuple[Any, ...]] = {
    "top_p": (1,), "top_k": (-1, 0), "min_p": (0,), "stop": ([], ""), "presence_penalty": (0,),
    "frequency_penalty": (0,), "repetition_penalty": (1,), "logit_bias": ({},), "stream": (False,),
    "logprobs": (False,), "top_logprobs": (0,), "response_format": ({"type": "text"},),
    "parallel_tool_calls": (True,)}


def _message(m: dict[str, Any]) -> Message:
    """A request message as compared and rendered (the SDK's other fields dropped)."""
    out: Message = {"role": m["role"], "content": m.get("content") or ""}
    if m.get("tool_calls"):
        out["tool_calls"] = [{"id": c["id"], "type": "function", "function": {
            "name": c["function"]["name"], "arguments": c["function"]["arguments"]}}
            for c in m["tool_calls"]]
    if m["role"] == "tool":
        out["tool_call_id"] = m.get("tool_call_id")
    return out


def _malformed(body: dict[str, Any]) -> str:
    """What is wrong with a request's ``messages`` and ``tools``, naming it; "" if nothing."""
    if not body.get("messages"):
        return "messages is empty"
    for i, m in enumerate(body["messages"]):
        where = f"messages[{i}]"
        if not isinstance(m, dict) or m.get("role") not in ("system", "user", "assistant", "tool"):
            return f"{where}: a message needs a role: system, user, assistant or tool"
        calls = m.get("tool_calls")
        if not (isinstance(m.get("content"), (str, list)) or (m["role"] == "assistant" and calls)):
            return (f"{where}.content: text or a list of parts (an assistant message with "
                    "tool_calls may have none)")
        if not all(isinstance(c, dict) and isinstance(c.get("id"), str)
                   and isinstance(c.get("function"), dict)
                   and isinstance(c["function"].get("name"), str)
                   and isinstance(c["function"].get("arguments"), str) for c in calls or []):
            return (f'{where}.tool_calls: each is {{"id": ..., "type": "function", '
                    '"function": {"name": ..., "arguments": "<JSON>"}}')
    if not all(isinstance(t, dict) and isinstance(t.get("function"), dict)
               and isinstance(t["function"].get("name"), str) for t in body.get("tools") or []):
        return 'tools: each is {"type": "function", "function": {"name": ..., "parameters": {...}}}'
    return ""


def _is_off(key: str, value: Any) -> bool:
    """Whether option ``key``'s ``value`` is None or one of its `_OFF` values (1.0 is 1; a bool is
    not a number: ``top_k: false`` is refused)."""
    return value is None or any(value == off and isinstance(value, bool) == isinstance(off, bool)
                                for off in _OFF.get(key, ()))


def _error(status: int, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": "invalid_request_error"}},
                             status=status)
