"""SyntheticSource: seeded, well-formed trajectory groups without a model.

Each group has ``group_size`` rollouts of one prompt; prompt tokens carry ``policy_version`` -1
and ``loss_mask`` false, completion tokens version 0, a random logprob in (-3, 0] and
``loss_mask`` true; ``score`` is 0 or 1. Replica r of N emits groups r, r + N, ...
``checkpoint_every_batches: k`` emits ``Barrier(b)`` after every k-th batch (b = batches so
far, the state).
"""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pyarrow as pa
from pydantic import Field

from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.runtime.stage import Port, Source, StageConfig
from molt.runtime.edges import Barrier

WRITES = ("sample_id", "prompt_id", "rollout_id", "segment_index", "token_ids", "loss_mask",
          "rollout_logprobs", "policy_version", "group_size", "score", "finish_reason", "metadata")


class SyntheticSource(Source):
    """Emits ``num_groups`` groups, ``groups_per_batch`` to a record batch."""

    class Config(StageConfig):
        num_groups: int = Field(8, ge=0, description="groups to emit in all")
        group_size: int = Field(4, ge=1, description="rollouts per prompt")
        groups_per_batch: int = Field(2, ge=1)
        prompt_tokens: int = Field(8, ge=1, description="tokens per prompt")
        max_new_tokens: int = Field(16, ge=1, description="completion length is 1..this")
        vocab_size: int = Field(1000, ge=2)
        seed: int | None = Field(None, description="None = the run's")
        checkpoint_every_batches: int = Field(0, ge=0, description="0 = no checkpoint barriers")

    outputs = {"out": Port(writes=WRITES)}
    config: Config

    def setup(self) -> None:
        self.schema = make_schema(resolve_fields(WRITES, "SyntheticSource"), "trajectory")
        self.num_batches = 0

    def state_dict(self) -> dict[str, int]:
        return {"num_batches": self.num_batches}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.num_batches = state["num_batches"]

    def generate(self) -> Iterator[pa.RecordBatch | Barrier]:
        c, ctx = self.config, self.ctx
        mine = list(range(ctx.replica, c.num_groups, ctx.num_replicas))
        for start in range(self.num_batches * c.groups_per_batch, len(mine), c.groups_per_batch):
            rows = [row for g in mine[start:start + c.groups_per_batch] for row in self._group(g)]
            self.num_batches += 1
            yield batch_from_rows(rows, self.schema)
            if c.checkpoint_every_batches and self.num_batches % c.checkpoint_every_batches == 0:
                yield Barrier(self.num_batches)

    def _group(self, g: int) -> list[dict]:
        c = self.config
        rng = random.Random((self.ctx.seed_for() if c.seed is None else c.seed) * 1_000_003 + g)
        prompt = [rng.randrange(c.vocab_size) for _ in range(c.prompt_tokens)]
        rows = []
        for k in range(c.group_size):
            n = rng.randint(1, c.max_new_tokens)
            completion = [rng.randrange(c.vocab_size) for _ in range(n)]
            rows.append({
                "sample_id": f"g{g}-s{k}", "prompt_id": f"g{g}", "rollout_id": f"g{g}-r{k}",
                "segment_index": 0, "token_ids": prompt + completion,
                "loss_mask": [False] * len(prompt) + [True] * n,
                "rollout_logprobs": [0.0] * len(prompt) + [-3 * rng.random() for _ in range(n)],
                "policy_version": [-1] * len(prompt) + [0] * n, "group_size": c.group_size,
                "score": float(rng.random() < 0.5),
                "finish_reason": "length" if n == c.max_new_tokens else "stop",
                "metadata": json.dumps({"group": g}),
            })
        return rows
