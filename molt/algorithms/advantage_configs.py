"""Advantage configs: select an estimator by its YAML `type:`, with no registry.

    advantage: {type: grpo, eps: 1.0e-6}

Each class has a `type` tag, `required_columns` (the record-batch columns it
reads) and `compute(AdvantageInputs) -> [N, T]`, which calls the function that
holds formula and paper. A new estimator is one function, plus one class added to
the `AdvantageConfig` discriminated union (an unknown `type` or key fails at load).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar, Literal, Sequence, Union

from pydantic import Field
from torch import Tensor

from molt.algorithms import advantages as adv
from molt.algorithms.groups import index_rollouts, rows_to_tokens
from molt.algorithms.token_advantages import (
    distillation_advantages,
    gae_advantages,
    outcome_token_rewards,
)
from molt.config import FrozenConfig


@dataclass(frozen=True)
class AdvantageInputs:
    """Columns of one advantage batch (N rows, padded to T tokens)."""

    prompt_ids: Sequence[str]  # [N]
    rollout_ids: Sequence[str]  # [N]
    rewards: Tensor  # [N] float
    loss_mask: Tensor  # [N, T] bool
    rollout_logprobs: Tensor | None = None  # [N, T]
    teacher_logprobs: Tensor | None = None  # [N, T]
    values: Tensor | None = None  # [N, T]


def _need(inputs: AdvantageInputs, column: str, kind: str) -> Tensor:
    value = getattr(inputs, column)
    if value is None:
        raise ValueError(
            f"{kind} advantages need the `{column}` column; got None; hint: add the "
            f"stage that fills `{column}` before the advantage stage"
        )
    return value


class _GroupEstimator(FrozenConfig):
    """Outcome estimators: one advantage per rollout, spread over its loss tokens."""

    required_columns: ClassVar[tuple[str, ...]] = ("prompt_id", "rollout_id", "reward")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """rewards [R], group_ids [R] -> [R] (advantages.py)."""
        raise NotImplementedError

    def compute(self, inputs: AdvantageInputs) -> Tensor:
        """A_it = estimate(...)[rollout(i)] * m_it, [N, T] (`adv.row_advantages`)."""
        rows = adv.row_advantages(
            self.estimate, inputs.prompt_ids, inputs.rollout_ids, inputs.rewards
        )
        return rows_to_tokens(rows, inputs.loss_mask)


class GRPOConfig(_GroupEstimator):
    type: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, description="added to the group std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return adv.grpo_advantages(rewards, group_ids, self.eps)


class DrGRPOConfig(_GroupEstimator):
    type: Literal["dr_grpo"] = "dr_grpo"

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return adv.dr_grpo_advantages(rewards, group_ids)


class RLOOConfig(_GroupEstimator):
    type: Literal["rloo"] = "rloo"

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return adv.rloo_advantages(rewards, group_ids)


class ReinforcePPConfig(_GroupEstimator):
    type: Literal["reinforce_pp"] = "reinforce_pp"
    eps: float = Field(1e-6, gt=0, description="added to the batch std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return adv.reinforce_pp_advantages(rewards, group_ids, self.eps)


class ReinforcePPBaselineConfig(_GroupEstimator):
    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    eps: float = Field(1e-6, gt=0, description="added to the batch std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        return adv.reinforce_pp_baseline_advantages(rewards, group_ids, self.eps)


class GAEConfig(FrozenConfig):
    type: Literal["gae"] = "gae"
    required_columns: ClassVar[tuple[str, ...]] = ("reward", "values")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per generated token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")

    def compute(self, inputs: AdvantageInputs) -> Tensor:
        """`gae_advantages` with the row's reward on its last loss token; one row per rollout."""
        index = index_rollouts(inputs.prompt_ids, inputs.rollout_ids, inputs.rewards)
        if index.rollout_group.numel() != len(inputs.prompt_ids):
            raise ValueError(
                f"gae needs one row per rollout; got {len(inputs.prompt_ids)} rows for "
                f"{index.rollout_group.numel()} rollouts; hint: use an outcome estimator "
                f"(grpo, rloo, ...) for multi-segment rollouts"
            )
        values = _need(inputs, "values", "gae")
        token_rewards = outcome_token_rewards(inputs.rewards, inputs.loss_mask)
        return gae_advantages(token_rewards, values, inputs.loss_mask, self.gamma, self.lam)[0]


class DistillationConfig(FrozenConfig):
    type: Literal["distillation"] = "distillation"
    required_columns: ClassVar[tuple[str, ...]] = ("rollout_logprobs", "teacher_logprobs")
    beta: float = Field(1.0, gt=0, description="weight of the per-token reverse KL")

    def compute(self, inputs: AdvantageInputs) -> Tensor:
        student = _need(inputs, "rollout_logprobs", "distillation")
        teacher = _need(inputs, "teacher_logprobs", "distillation")
        return distillation_advantages(student, teacher, inputs.loss_mask, self.beta)


AdvantageConfig = Annotated[
    Union[
        GRPOConfig, DrGRPOConfig, RLOOConfig, ReinforcePPConfig,
        ReinforcePPBaselineConfig, GAEConfig, DistillationConfig,
    ],
    Field(discriminator="type"),
]
