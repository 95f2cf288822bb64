"""Tools an agent calls: the `Tool` contract, tool-call parsers, and tools in chat templates.

A policy calls a tool by generating the call as text; a `ToolParser` finds the calls in the
decoded turn (``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks;
a block may hold a JSON list; a tag quoted in its JSON is text). A call that cannot be read is
*malformed*: the turn is returned as its text, with the reason, never repaired. For a template
that ignores ``tools``, `fallback_messages` puts the tools in the system message (Qwen2.5's
wording), calls in the parser's format, and tool results in user messages of
``<tool_response>`` blocks.
"""

from __future__ import annotations

import abc
import dataclasses
import json
import re
from collections.abc import Sequence
from typing import Any, ClassVar

Message = dict[str, Any]  # molt.agents.base.Message, which imports this module


class Tool(abc.ABC):
    """A function an agent may call; ``parameters`` is the JSON schema of its arguments."""

    name: ClassVar[str]
    description: ClassVar[str] = ""
    parameters: ClassVar[dict[str, Any]] = {"type": "object", "properties": {}}

    @abc.abstractmethod
    def call(self, arguments: dict[str, Any]) -> str:
        """The text the policy reads; an exception is reported to it as ``error: ...``."""

    @classmethod
    def schema(cls) -> dict[str, Any]:
        return {"type": "function", "function": {"name": cls.name, "description": cls.description,
                                                 "parameters": cls.parameters}}


def run_tool(tools: dict[str, Tool], call: ToolCall) -> str:
    """The result text of ``call``; an unknown name or an exception is an ``error: ...``."""
    tool = tools.get(call.name)
    if tool is None:
        return f"error: no tool named {call.name!r}; the tools are {sorted(tools)}"
    try:
        return tool.call(call.arguments)
    except Exception as e:  # noqa: BLE001 - the policy's information, not the rollout's failure
        return f"error: {type(e).__name__}: {e}"


@dataclasses.dataclass(frozen=True)
class ToolCall:
    """One parsed call; ``id`` is unique in the rollout. ``arguments_text``: the arguments'
    JSON as sampled; "" for a call made in code, written unescaped (``"café"``)."""

    id: str
    name: str
    arguments: dict[str, Any]
    arguments_text: str = dataclasses.field(default="", compare=False)

    def openai(self) -> dict[str, Any]:
        """The call as the OpenAI API writes it (``arguments`` a JSON string)."""
        text = self.arguments_text or json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function",
                "function": {"name": self.name, "arguments": text}}


@dataclasses.dataclass(frozen=True)
class ParsedTurn:
    """``content``: the text outside calls (None if empty); ``malformed``: why the call text is
    not a call ("" when none is)."""

    content: str | None
    calls: list[ToolCall]
    malformed: str = ""


class ToolParser(abc.ABC):
    """Finds tool calls in generated text; writes calls and tool definitions in its format."""

    name: ClassVar[str]
    tags: ClassVar[tuple[str, ...]] = ()  # the call markers, kept by decoding if special tokens

    @abc.abstractmethod
    def parse(self, text: str, call_prefix: str) -> ParsedTurn:
        """The calls in ``text``, with ids ``{call_prefix}_{i}``."""

    @abc.abstractmethod
    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        """The text of OpenAI ``tool_calls`` in this format."""

    @abc.abstractmethod
    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        """The system-message text that defines ``tools`` (OpenAI definitions)."""


_JSON = json.JSONDecoder()


def _ws(text: str, i: int) -> int:
    """The index of the first non-whitespace character of ``text`` from ``i``."""
    return len(text) - len(text[i:].lstrip())


def _arguments_text(call: str, arguments: dict[str, Any]) -> str:
    """The text of the first ``"arguments"`` member of the JSON text ``call`` whose value is
    ``arguments`` ("" if none); a quote in a JSON string is escaped, so strings never match."""
    for m in re.finditer(r'"arguments"\s*:\s*', call):
        value, end = _JSON.raw_decode(call, m.end())
        if value == arguments:
            return call[m.end():end]
    return ""


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` blocks; the JSON ends where
    `json.JSONDecoder.raw_decode` says."""

    name = "hermes"
    tags = ("<tool_call>", "</tool_call>")

    def parse(self, text: str, call_prefix: str) -> ParsedTurn:
        calls: list[ToolCall] = []
        outside, end = [], 0
        while (start := text.find(self.tags[0], end)) >= 0:
            outside.append(text[end:start])
            try:
                found, end = self._block(text, start + len(self.tags[0]))
            except ValueError as e:
                return ParsedTurn(text, [], f"the {self.tags[0]} at character {start}: {e}")
            calls += [ToolCall(f"{call_prefix}_{len(calls) + k}", *c) for k, c in enumerate(found)]
        content = "".join([*outside, text[end:]]).strip()
        return ParsedTurn(content or None, calls)

    def _block(self, text: str, i: int) -> tuple[list[tuple[str, dict[str, Any], str]], int]:
        """``(name, arguments, arguments_text)`` of each call of the block whose JSON starts at
        ``text[i]`` (after whitespace), and the end of its ``</tool_call>``; ValueError if none."""
        cut = "the text ends inside the call (cut by max_new_tokens?)"
        i = _ws(text, i)
        try:
            if text[i:i + 1] not in ("{", "["):
                raise json.JSONDecodeError("Expecting '{' or '['", text, i)
            value, end = _JSON.raw_decode(text, i)
        except json.JSONDecodeError as e:
            short = re.fullmatch(r"[\w.+-]*\s*", text[e.pos:], re.ASCII)  # a literal cut short
            raise ValueError(cut if short or e.msg.startswith("Unterminated") else
                             f"the call is not JSON ({e})") from None
        items = value if isinstance(value, list) else [value]
        if not items:
            raise ValueError("an empty list of calls")
        if not all(isinstance(c, dict) and isinstance(c.get("name"), str)
                   and isinstance(c.get("arguments", {}), dict) for c in items):
            raise ValueError('a call is not {"name": string, "arguments": object}')
        close, tag = _ws(text, end), self.tags[1]
        if not text.startswith(tag, close):
            raise ValueError(cut if tag.startswith(text[close:]) else
                             f"the call is followed by {text[close:close + 20]!r}, not {tag}")
        args = [c.get("arguments", {}) for c in items]
        return ([(c["name"], a, _arguments_text(text[i:end], a)) for c, a in zip(items, args)],
                close + len(tag))

    def render_calls(self, calls: list[dict[str, Any]]) -> str:
        names = [json.dumps(c["function"]["name"], ensure_ascii=False) for c in calls]
        return "".join(f'<tool_call>\n{{"name": {n}, "arguments": {c["function"]["arguments"]}}}'
                       "\n</tool_call>" for n, c in zip(names, calls))

    def tools_prompt(self, tools: Sequence[dict[str, Any]]) -> str:
        return ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n"
                "<tools>\n" + "\n".join(json.dumps(t) for t in tools) + "\n</tools>\n\n"
                "For each function call, return a json object with function name and arguments "
                "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
                '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>')


TOOL_PARSERS: dict[str, type[ToolParser]] = {HermesParser.name: HermesParser}


def tool_parser(name: str, where: str) -> ToolParser:
    """The parser named ``name`` (`TOOL_PARSERS`) or imported from its path.

    Raises:
        ValueError: neither, naming ``where``.
    """
    from molt.config import import_class

    if name in TOOL_PARSERS:
        return TOOL_PARSERS[name]()
    if "." not in name:
        raise ValueError(f"{where}: no tool parser {name!r}; built in: {sorted(TOOL_PARSERS)}, "
                         "or an import path")
    cls = import_class(name, where)
    if not (isinstance(cls, type) and issubclass(cls, ToolParser)):
        raise ValueError(f"{where}: {name} is not a molt.agents.tools.ToolParser subclass")
    return cls()


def template_messages(messages: list[Message]) -> list[Message]:
    """``messages`` with the ``arguments`` of an assistant's ``tool_calls`` as objects (the
    Hugging Face convention), not JSON strings."""
    out = []
    for m in messages:
        if m.get("tool_calls"):
            m = {**m, "content": m.get("content") or "", "tool_calls": [
                {"type": "function", "function": {
                    "name": c["function"]["name"],
                    "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]}
        out.append(m)
    return out


def fallback_messages(messages: list[Message], tools: Sequence[dict[str, Any]],
                      parser: ToolParser) -> list[Message]:
    """``messages`` rewritten for a template that does not render tools."""
    system = parser.tools_prompt(tools)
    out: list[Message] = []
    for m in messages:
        if m["role"] == "system" and not out:
            m = {"role": "system", "content": f"{m['content']}\n\n{system}"}
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = parser.render_calls(m["tool_calls"])
            m = {"role": "assistant", "content": (m.get("content") or "") + calls}
        elif m["role"] == "tool":
            block = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": f"{out[-1]['content']}\n{block}"}
                continue
            m = {"role": "user", "content": block, "tool_results": True}
        out.append(m)
    if not messages or messages[0]["role"] != "system":
        out.insert(0, {"role": "system", "content": system})
    return [{k: v for k, v in m.items() if k != "tool_results"} for m in out]
