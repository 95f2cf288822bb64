"""GroupAdvantage: adds per-token ``advantages`` with the estimator named in YAML.

``config.estimator`` selects a function of :mod:`molt.algorithms` by ``type:``
(grpo, dr_grpo, rloo, reinforce_pp, reinforce_pp_baseline, gae, distillation); see
:mod:`molt.algorithms.advantage_configs`. Group statistics are taken over the rows
of each batch, which holds whole groups (the rollout stage emits a group per batch
and a keyed edge never splits one); rows of one multi-segment rollout count once.
Example: 2 prompts x 3 samples, rewards [1, 0, 0 | 1, 1, 1] under GRPO -> the first
group gets [1.1547, -0.5774, -0.5774] on every generated token, the second 0.

    advantage: {class: stages.group_advantage.GroupAdvantage, config: {estimator: {type: rloo}}}
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from molt.algorithms.advantage_configs import AdvantageConfig, AdvantageInputs, GRPOConfig
from molt.algorithms.policy_metrics import group_metrics
from molt.columns import padded, row_lengths, unpadded
from molt.schema import COLUMNS
from molt.runtime.stage import Port, StageConfig, Transform

_OPTIONAL = ("rollout_logprobs", "teacher_logprobs", "values")


class GroupAdvantage(Transform):
    """Adds ``advantages`` [T] (0 where ``loss_mask`` is false) to every row."""

    class Config(StageConfig):
        estimator: AdvantageConfig = Field(default_factory=GRPOConfig)  # type: ignore[assignment]

    config: Config

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        assert isinstance(config, cls.Config)
        reads = ("prompt_id", "rollout_id", "loss_mask", "finish_reason",
                 *(c for c in type(config.estimator).required_columns
                   if c not in ("prompt_id", "rollout_id")))
        return {"in": Port(reads=reads)}, {"out": Port(passes="in", writes=("advantages",))}

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch:
        names = batch.schema.names
        rewards = ([0.0] * batch.num_rows if "reward" not in names
                   else np.array(batch.column("reward").to_numpy(zero_copy_only=False)))
        inputs = AdvantageInputs(
            prompt_ids=batch.column("prompt_id").to_pylist(),
            rollout_ids=batch.column("rollout_id").to_pylist(),
            rewards=torch.as_tensor(rewards, dtype=torch.float32),
            loss_mask=padded(batch, "loss_mask", torch.bool),
            **{c: padded(batch, c, torch.float32) for c in _OPTIONAL if c in names})
        if torch.isnan(inputs.rewards).any():
            row = int(torch.isnan(inputs.rewards).nonzero()[0])
            bad = batch.column("sample_id")[row] if "sample_id" in names else "?"
            raise ValueError(f"column 'reward' is null in row {bad}; hint: count failed rollouts "
                             "before the advantage stage instead of passing a null reward")
        advantages = self.config.estimator.compute(inputs)  # [N, T]
        self._log(batch, inputs, advantages)
        column = unpadded(advantages, row_lengths(batch, "loss_mask"), pa.float32())
        return batch.append_column(COLUMNS["advantages"], column)

    def _log(self, batch: pa.RecordBatch, inputs: AdvantageInputs,
             advantages: torch.Tensor) -> None:
        if "reward" not in batch.schema.names:
            return
        mask = inputs.loss_mask
        rows = torch.where(mask, advantages, 0).sum(1) / mask.sum(1).clamp(min=1)
        self.metrics.log(group_metrics(inputs.prompt_ids, inputs.rollout_ids, inputs.rewards,
                                       batch.column("finish_reason").to_pylist(), rows))
