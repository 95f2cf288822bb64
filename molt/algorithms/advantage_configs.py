"""Advantage configs: select an estimator by its YAML `type:`, with no registry.

Each config class carries a `type: Literal[...]` tag and one method that calls
its function, so adding an estimator is one function plus one class here, added
to the `AdvantageConfig` union. The union is a pydantic discriminated union: an
unknown `type` or key fails at load, naming the valid choices.

    advantage: {type: grpo, eps: 1.0e-6}

`compute(AdvantageInputs) -> [N, T]` is the one call an advantage stage makes;
`required_columns` lists the record-batch columns it reads.
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
    """Columns of one advantage batch (N rows, padded to T tokens); optional ones may be None."""

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
        """Subclasses: rewards [R], group_ids [R] -> [R] (formula and paper there);
        empty -> [0]."""
        raise NotImplementedError

    def compute(self, inputs: AdvantageInputs) -> Tensor:
        """Advantages [N, T], 0 off-mask: A_it = estimate(...)[rollout(i)] * m_it.

        Formula and paper: the class's `estimate` (advantages.py). Shapes: inputs of
        N rows, loss_mask [N, T] -> [N, T]. Empty ([0, T], [N, 0]) -> zeros of the
        mask's shape; an all-masked row -> zeros.
        """
        rows = adv.row_advantages(
            self.estimate, inputs.prompt_ids, inputs.rollout_ids, inputs.rewards
        )
        return rows_to_tokens(rows, inputs.loss_mask)


class GRPOConfig(_GroupEstimator):
    type: Literal["grpo"] = "grpo"
    eps: float = Field(1e-6, gt=0, description="added to the group std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """(r - mean_g) / (std_g + eps); GRPO, Shao et al. 2024, arXiv:2402.03300."""
        return adv.grpo_advantages(rewards, group_ids, self.eps)


class DrGRPOConfig(_GroupEstimator):
    type: Literal["dr_grpo"] = "dr_grpo"

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """r - mean_g; Dr.GRPO, Liu et al. 2025, arXiv:2503.20783."""
        return adv.dr_grpo_advantages(rewards, group_ids)


class RLOOConfig(_GroupEstimator):
    type: Literal["rloo"] = "rloo"

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """r - mean of the others in g; RLOO, Ahmadian et al. 2024, arXiv:2402.14740."""
        return adv.rloo_advantages(rewards, group_ids)


class ReinforcePPConfig(_GroupEstimator):
    type: Literal["reinforce_pp"] = "reinforce_pp"
    eps: float = Field(1e-6, gt=0, description="added to the batch std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """(r - mean_B) / (std_B + eps); REINFORCE++, Hu 2025, arXiv:2501.03262."""
        return adv.reinforce_pp_advantages(rewards, group_ids, self.eps)


class ReinforcePPBaselineConfig(_GroupEstimator):
    type: Literal["reinforce_pp_baseline"] = "reinforce_pp_baseline"
    eps: float = Field(1e-6, gt=0, description="added to the batch std")

    def estimate(self, rewards: Tensor, group_ids: Tensor) -> Tensor:
        """(r - mean_g) / (std_B + eps); REINFORCE++-baseline, Hu 2025, arXiv:2501.03262."""
        return adv.reinforce_pp_baseline_advantages(rewards, group_ids, self.eps)


class GAEConfig(FrozenConfig):
    type: Literal["gae"] = "gae"
    required_columns: ClassVar[tuple[str, ...]] = ("reward", "values")
    gamma: float = Field(1.0, ge=0, le=1, description="discount per generated token")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda")

    def compute(self, inputs: AdvantageInputs) -> Tensor:
        """GAE with the row's reward on its last loss token; one segment per rollout.

        A_t = sum_l (gamma lam)^l delta_{t+l}, delta_t = r_t + gamma V_{t+1} - V_t
        (Schulman et al. 2016, arXiv:1506.02438). Shapes: rewards [N], values and
        loss_mask [N, T] -> [N, T]. Empty ([0, T], [N, 0]) -> zeros of that shape;
        an all-masked row -> zeros.
        """
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
        """On-policy distillation: A_t = -beta * (log pi(y_t) - log pi_teacher(y_t)).

        Agarwal et al. 2024 (GKD, arXiv:2306.13649); Thinking Machines 2025 blog.
        Shapes: logprobs and loss_mask [N, T] -> [N, T]. Empty or all-masked -> zeros.
        """
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
