"""Chat-template token ids without ever re-encoding what the policy generated.

After a policy turn only the *delta* is tokenized: what the template puts after an assistant
message, the next messages and the generation prompt, found as the suffix a probe
conversation gains; a template that rewrites earlier turns raises. Image parts become the
processor's placeholder, expanded into each image's tokens (molt.models.images).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from molt.agents.base import Message
from molt.agents.tools import (HermesParser, ToolParser, fallback_messages, template_messages,
                               tool_parser)
from molt.models.images import VisionProcessor, flatten_messages

_PROBE = "\u2063molt-probe\u2063"
_PROBE_TOOL = {"type": "function", "function": {"name": "molt_probe", "description": "",
                                                "parameters": {"type": "object", "properties": {}}}}


class ChatTemplate:
    """Renders prompts and turn deltas with a Hugging Face tokenizer's template."""

    def __init__(self, tokenizer: Any, vision: VisionProcessor | None = None,
                 tool_parser: ToolParser | None = None) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template; hint: use an instruct model "
                             "whose tokenizer_config.json or chat_template.jinja defines one")
        self.tok, self.vision = tokenizer, vision
        eos = tokenizer.eos_token_id
        self.eos_text = tokenizer.decode([eos]) if eos is not None else ""
        self.tool_parser = tool_parser or HermesParser()
        added, tags = tokenizer.added_tokens_decoder.items(), self.tool_parser.tags
        self._dropped = ({*tokenizer.all_special_ids, *(i for i, t in added if t.special)}
                         - {i for i, t in added if t.content in tags})  # decode keeps the tags
        try:
            probe = [{"role": "user", "content": "x"}]
            rendered = tokenizer.apply_chat_template(probe, tools=[_PROBE_TOOL], tokenize=False)
            self.renders_tools = "molt_probe" in rendered
        except Exception:  # noqa: BLE001 - a template that fails on tools does not render them
            self.renders_tools = False

    @classmethod
    def for_model(cls, model_dir: Any, tool_format: str = "hermes",
                  where: str = "tool_parser") -> ChatTemplate:
        """A model folder's template, image processor (if any) and ``tool_format``'s parser."""
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        vision = VisionProcessor.of(model_dir, tokenizer)
        return cls(tokenizer, vision, tool_parser(tool_format, where))

    def render(self, messages: list[Message], add_generation_prompt: bool,
               tools: Sequence[dict[str, Any]] = ()) -> str:
        native = self.renders_tools or not tools
        flat, _ = flatten_messages(messages, self._placeholder, "chat template")
        flat = (template_messages(flat) if native
                else fallback_messages(flat, tools, self.tool_parser))
        return str(self.tok.apply_chat_template(
            flat, tools=list(tools) if tools and native else None, tokenize=False,
            add_generation_prompt=add_generation_prompt))

    @property
    def _placeholder(self) -> str | None:
        return self.vision.placeholder if self.vision else None

    @property
    def image_token_id(self) -> int | None:
        return self.vision.image_token_id if self.vision is not None else None

    def images(self, messages: list[Message]) -> list[bytes]:
        return flatten_messages(messages, self._placeholder, "chat template")[1]

    def encode(self, text: str, images: list[bytes] | None = None) -> list[int]:
        """Token ids of template text (special tokens parsed, no BOS), image placeholders
        expanded into ``images``' tokens."""
        ids = list(self.tok.encode(text, add_special_tokens=False))
        return self.vision.expand(ids, images or []) if self.vision is not None else ids

    def prompt_ids(self, messages: list[Message],
                   tools: Sequence[dict[str, Any]] = ()) -> list[int]:
        """[P] token ids of the opening messages and ``tools`` plus the generation prompt."""
        return self.encode(self.render(messages, True, tools), self.images(messages))

    def decode(self, token_ids: list[int]) -> str:
        """Text of generated tokens (for envs, graders and the tool parser, never for training):
        special tokens dropped, except the tool parser's tags."""
        kept = [t for t in token_ids if t not in self._dropped]
        return str(self.tok.decode(kept, skip_special_tokens=False))

    def turn_delta_ids(self, messages: list[Message], new: list[Message], ended_with_eos: bool,
                       tools: Sequence[dict[str, Any]] = ()) -> list[int]:
        """Token ids after the assistant turn ending ``messages`` that render ``new`` (with the
        end-of-turn text unless the turn ended with EOS).

        Raises:
            ValueError: the template renders earlier turns differently once ``new`` is added.
        """
        probe = [*messages[:-1], {"role": "assistant", "content": _PROBE}]
        before = self.render(probe, False, tools)
        after = self.render([*probe, *new], True, tools)
        if not after.startswith(before):
            raise ValueError("the chat template rewrites earlier turns when a message is added; "
                             "hint: this turn must start a new segment")
        closing = before[before.rindex(_PROBE) + len(_PROBE):]
        if ended_with_eos and closing.startswith(self.eos_text):
            closing = closing[len(self.eos_text):]  # the engine generated the EOS itself
        return self.encode(closing + after[len(before):], self.images(new))

    def demonstration_ids(self, messages: list[Message],
                          tools: Sequence[dict[str, Any]] = ()) -> tuple[list[int], list[bool]]:
        """[T] token ids and loss mask of a demonstrated conversation, laid out as a rollout's:
        each assistant turn as the policy would generate it (mask true), then the delta.

        Raises:
            ValueError: no assistant turn, or the template rewrites earlier turns.
        """
        turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
        if not turns:
            raise ValueError("a demonstration needs at least one assistant turn")
        ids = self.prompt_ids(messages[:turns[0]], tools)
        mask = [False] * len(ids)
        for i, end in zip(turns, [*turns[1:], None]):
            m = messages[i]
            calls = self.tool_parser.render_calls(m["tool_calls"]) if m.get("tool_calls") else ""
            text = (m.get("content") or "") + calls
            policy = self.encode(text) + [self.tok.eos_token_id]
            context = (self.turn_delta_ids(messages[:i + 1], messages[i + 1:end], True, tools)
                       if end else [])
            ids, mask = ids + policy + context, mask + [True] * len(policy) + [False] * len(context)
        return ids, mask
