"""ShapeReward: ``reward`` = ``score`` plus DAPO's soft overlong punishment.

``reward = score + overlong_penalty_factor * penalty(L)``, L the number of generated tokens
(``sum(loss_mask)``) and ``penalty`` molt.algorithms.dapo.overlong_penalty (DAPO, arXiv
2503.14476, eq. 13) with ``L_max`` = ``max_new_tokens`` and ``L_cache`` =
``overlong_buffer_tokens``; 0 (the default) shapes nothing. A null score (a failed rollout)
stays null. Example: L_max 16, L_cache 4, L 14 -> penalty (12 - 14) / 4 = -0.5.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch
from pydantic import Field

from molt.algorithms.dapo import overlong_penalty
from molt.schema import COLUMNS
from molt.runtime.stage import Port, StageConfig, Transform


class ShapeReward(Transform):
    """Adds ``reward`` from ``score`` and the completion length (sum of ``loss_mask``)."""

    class Config(StageConfig):
        max_new_tokens: int = Field(1024, ge=1, description="L_max: the rollout's token budget")
        overlong_buffer_tokens: int = Field(0, ge=0, description="L_cache; 0 = no shaping")
        overlong_penalty_factor: float = Field(1.0, ge=0)

    inputs = {"in": Port(reads=("score", "loss_mask"))}
    outputs = {"out": Port(passes="in", writes=("reward",))}
    config: Config

    def setup(self) -> None:
        c = self.config
        if c.overlong_buffer_tokens > c.max_new_tokens:
            raise ValueError(f"stages.{self.ctx.stage_id}.config.overlong_buffer_tokens: "
                             f"{c.overlong_buffer_tokens} exceeds max_new_tokens "
                             f"{c.max_new_tokens}")

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        c = self.config
        scores = np.array(batch.column("score").to_numpy(zero_copy_only=False))  # null -> nan
        rewards = torch.as_tensor(scores, dtype=torch.float32)
        if c.overlong_buffer_tokens:
            lengths = torch.tensor([sum(m) for m in batch.column("loss_mask").to_pylist()])
            penalty = overlong_penalty(lengths, c.max_new_tokens, c.overlong_buffer_tokens)
            rewards = rewards + c.overlong_penalty_factor * penalty
        column = pa.array(rewards.numpy(), pa.float32(), from_pandas=True)  # nan -> null again
        self.metrics.log({"reward_mean": pc.mean(column).as_py() or 0.0})
        return batch.append_column(COLUMNS["reward"], column)
