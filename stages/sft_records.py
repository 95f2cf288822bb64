"""SFTRecords: task prompts -> supervised prompt/response rows for ``policy_loss: {type: sft}``.

Each prompt row becomes one trajectory row, a group of one: the task's ``messages`` in the
model's chat template (images as its image tokens), then the tokens of the task's
``response_field`` and the tokenizer's EOS. ``loss_mask`` is true exactly on the response,
``policy_version`` -1 everywhere. With ``demonstrations`` (a class with ``demonstration(task)
-> (messages, tools)``, e.g. molt.agents.python_agent.PythonAgent) a row is that multi-turn
conversation, laid out as a rollout's: ``loss_mask`` true on every assistant turn, false on the
tool results. A record without the response, or whose row exceeds ``max_tokens``, is refused
naming its ``prompt_id``: no row is silently cut.

    sft:
      class: stages.sft_records.SFTRecords
      config: {model: smollm2-135m-instruct-moe-vlm, response_field: answer, max_tokens: 512}
"""

from __future__ import annotations

import json
from typing import Any

import pyarrow as pa
from pydantic import Field

from molt.agents import ChatTemplate
from molt.policy import policy_field
from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import Port, StageConfig, Transform

WRITES = ("sample_id", "rollout_id", "segment_index", "token_ids", "loss_mask", "policy_version",
          "group_size", "finish_reason", "images", "image_token_positions")


class SFTRecords(Transform):
    """Prompt rows in, one prompt/response trajectory row out per prompt."""

    class Config(StageConfig):
        model: str = policy_field("model", "smollm2-135m-instruct",
                                  description="its chat template and image processor are used")
        response_field: str = Field("answer", description="task field holding the demonstration")
        max_tokens: int = Field(2048, ge=2, description="longest row (prompt + response + EOS)")
        demonstrations: str | None = Field(None, description="import path: multi-turn rows")
        tool_parser: str = policy_field("tool_parser", "hermes")

    inputs = {"in": Port(reads=("prompt_id", "metadata"))}
    outputs = {"out": Port(writes=("prompt_id", "metadata", *WRITES))}
    config: Config

    def setup(self) -> None:
        from molt.config import import_class
        from molt.models import resolve_model

        c, where = self.config, f"stages.{self.ctx.stage_id}.config"
        self.chat = ChatTemplate.for_model(resolve_model(c.model), c.tool_parser,
                                           f"{where}.tool_parser")
        self.demonstrate = (import_class(c.demonstrations, f"{where}.demonstrations")
                            if c.demonstrations else None)
        if self.demonstrate is not None and not callable(
                getattr(self.demonstrate, "demonstration", None)):
            raise ValueError(f"{where}.demonstrations: {c.demonstrations} has no "
                             "demonstration(task) method")
        self.eos = self.chat.tok.eos_token_id
        if self.eos is None:
            raise ValueError(f"{where}.model: the tokenizer has no EOS token to end a "
                             "demonstration with")
        self.schema = make_schema(resolve_fields(self.outputs["out"].writes, "SFTRecords"),
                                  "trajectory")

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        prompt_ids, metadata = (batch.column(c).to_pylist() for c in ("prompt_id", "metadata"))
        rows = [self.row(p, json.loads(m)) for p, m in zip(prompt_ids, metadata)]
        self.metrics.count("records", len(rows))
        self.metrics.count("response_tokens", sum(sum(r["loss_mask"]) for r in rows))
        return batch_from_rows(rows, self.schema)

    def row(self, prompt_id: str, task: dict[str, Any]) -> dict[str, Any]:
        """The trajectory row of one task record (module docstring).

        Raises:
            ValueError: naming ``prompt_id``: no response field, no messages, or too long.
        """
        c, where = self.config, f"stages.{self.ctx.stage_id}: prompt {prompt_id!r}"
        if not task.get("messages") or task.get(c.response_field) is None and not c.demonstrations:
            raise ValueError(f"{where}: the record needs 'messages' and {c.response_field!r} "
                             f"(response_field); got keys {sorted(task)}")
        if self.demonstrate is not None:
            messages, tools = self.demonstrate.demonstration(task)
            ids, mask = self.chat.demonstration_ids(messages, tools)
        else:
            messages = task["messages"]
            prompt = self.chat.prompt_ids(messages)
            ids = prompt + self.chat.encode(str(task[c.response_field])) + [self.eos]
            mask = [False] * len(prompt) + [True] * (len(ids) - len(prompt))
        if len(ids) > c.max_tokens:
            raise ValueError(f"{where}: {len(ids)} tokens ({sum(mask)} of them the response) "
                             f"exceed max_tokens {c.max_tokens}; hint: raise max_tokens, the row "
                             "is never cut")
        images, image_token = self.chat.images(messages), self.chat.image_token_id
        positions = [i for i, t in enumerate(ids) if t == image_token] if images else None
        sample_id = f"{prompt_id}/sft"
        return {"prompt_id": prompt_id, "metadata": json.dumps(task), "sample_id": sample_id,
                "rollout_id": sample_id, "segment_index": 0, "token_ids": ids,
                "loss_mask": mask, "policy_version": [-1] * len(ids), "group_size": 1,
                "finish_reason": "stop", "images": images or None,
                "image_token_positions": positions}
