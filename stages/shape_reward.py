"""ShapeReward: ``reward`` = ``score`` plus DAPO's soft overlong punishment.

Soft overlong punishment (DAPO, Yu et al. 2025, arXiv 2503.14476, eq. 13), with
``L_max`` = ``max_new_tokens`` and ``L_cache`` = ``overlong_buffer_tokens``, for a
completion of ``L`` generated tokens::

    penalty(L) = 0                              if L <= L_max - L_cache
               = ((L_max - L_cache) - L) / L_cache   if L_max - L_cache < L <= L_max
               = -1                             if L > L_max

``reward = score + overlong_penalty_factor * penalty(L)``. With
``overlong_buffer_tokens: 0`` (the default) nothing is shaped and reward == score.
Example: L_max 16, L_cache 4, L 14 -> penalty (12 - 14) / 4 = -0.5.
"""

from __future__ import annotations

from typing import ClassVar

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from molt.schema import COLUMNS
from molt.stage import Port, StageConfig, Transform


def overlong_penalty(num_tokens: int, max_new_tokens: int, buffer_tokens: int) -> float:
    """DAPO soft overlong punishment in [-1, 0] for a completion of ``num_tokens``."""
    free = max_new_tokens - buffer_tokens
    if buffer_tokens == 0 or num_tokens <= free:
        return 0.0
    if num_tokens > max_new_tokens:
        return -1.0
    return (free - num_tokens) / buffer_tokens


class ShapeReward(Transform):
    """Adds ``reward`` from ``score`` and the completion length (sum of ``loss_mask``)."""

    class Config(StageConfig):
        max_new_tokens: int = Field(1024, ge=1, description="L_max: the rollout's token budget")
        overlong_buffer_tokens: int = Field(0, ge=0, description="L_cache; 0 = no shaping")
        overlong_penalty_factor: float = Field(1.0, ge=0)

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("score", "loss_mask"))}
    outputs: ClassVar[dict[str, Port]] = {"out": Port(passes="in", writes=("reward",))}
    config: Config

    def setup(self) -> None:
        c = self.config
        if c.overlong_buffer_tokens > c.max_new_tokens:
            raise ValueError(f"stages.{self.ctx.stage_id}.config.overlong_buffer_tokens: "
                             f"{c.overlong_buffer_tokens} exceeds max_new_tokens {c.max_new_tokens}")

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        c = self.config
        lengths = [sum(m) for m in batch.column("loss_mask").to_pylist()]
        scores = batch.column("score").to_pylist()
        rewards = [None if s is None else
                   s + c.overlong_penalty_factor * overlong_penalty(n, c.max_new_tokens, c.overlong_buffer_tokens)
                   for s, n in zip(scores, lengths)]
        self.metrics.log({"reward_mean": pc.mean(pa.array(rewards, pa.float32())).as_py() or 0.0})
        return batch.append_column(COLUMNS["reward"], pa.array(rewards, pa.float32()))
