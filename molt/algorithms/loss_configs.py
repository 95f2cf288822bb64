"""Trainer-side configs: policy loss, off-policy correction, KL term, loss aggregation.

As in advantage_configs.py, a `type` tag per class, one method that calls the
function holding formula, paper and edge cases, and a discriminated union per choice:

    policy_loss: {type: ppo, clip_low: 0.2, clip_high: 0.28, dual_clip: 3.0}
    correction: {type: icepop, low: 0.5, high: 5.0}
    kl: {estimator: k3, coef: 0.001, apply_to: loss}
    aggregation: {type: seq_mean_token_sum, normalizer: 4096}

An unknown `type` or key fails at load naming the choices.
"""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import Field
from torch import Tensor

from molt.algorithms import corrections as corr
from molt.algorithms import losses
from molt.algorithms.aggregation import aggregate_loss
from molt.algorithms.kl import KLEstimator, kl_penalty
from molt.config import FrozenConfig


class PPOLossConfig(FrozenConfig):
    type: Literal["ppo"] = "ppo"
    clip_low: float = Field(0.2, ge=0, lt=1, description="ratio floor is 1 - clip_low")
    clip_high: float = Field(
        0.2, ge=0, description="ratio ceiling is 1 + clip_high (DAPO: 0.28)"
    )
    dual_clip: float | None = Field(
        None, gt=1, description="cap on the loss of A < 0 tokens, in units of |A|"
    )

    def compute(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor
    ) -> losses.PolicyLoss:
        return losses.ppo_clip_loss(
            logprobs, old_logprobs, advantages, loss_mask,
            self.clip_low, self.clip_high, self.dual_clip,
        )


class GSPOLossConfig(FrozenConfig):
    type: Literal["gspo"] = "gspo"
    clip_low: float = Field(3e-4, ge=0, lt=1, description="sequence ratio floor 1 - clip_low")
    clip_high: float = Field(4e-4, ge=0, description="sequence ratio ceiling 1 + clip_high")

    def compute(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor
    ) -> losses.PolicyLoss:
        return losses.gspo_loss(
            logprobs, old_logprobs, advantages, loss_mask, self.clip_low, self.clip_high
        )


class CISPOLossConfig(FrozenConfig):
    type: Literal["cispo"] = "cispo"
    clip_high: float = Field(gt=0, description="IS weight ceiling 1 + clip_high")
    clip_low: float | None = Field(None, ge=0, lt=1, description="IS weight floor; None: none")

    def compute(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor
    ) -> losses.PolicyLoss:
        return losses.cispo_loss(
            logprobs, old_logprobs, advantages, loss_mask, self.clip_high, self.clip_low
        )


class SFTLossConfig(FrozenConfig):
    """Supervised fine-tuning: records need no rollout_logprobs or advantages;
    with ``correction: {type: none}`` only."""

    type: Literal["sft"] = "sft"

    def compute(
        self, logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, loss_mask: Tensor
    ) -> losses.PolicyLoss:
        return losses.sft_loss(logprobs, loss_mask)


PolicyLossConfig = Annotated[
    Union[PPOLossConfig, GSPOLossConfig, CISPOLossConfig, SFTLossConfig],
    Field(discriminator="type"),
]


class NoCorrectionConfig(FrozenConfig):
    type: Literal["none"] = "none"

    def compute(
        self, train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
    ) -> corr.Correction:
        return corr.no_correction(train_logprobs, rollout_logprobs, loss_mask)


class TISConfig(FrozenConfig):
    type: Literal["tis"] = "tis"
    cap: float = Field(2.0, gt=0, description="ceiling of the token IS weight (paper: 2)")

    def compute(
        self, train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
    ) -> corr.Correction:
        return corr.truncated_is(train_logprobs, rollout_logprobs, loss_mask, self.cap)


class IcePopConfig(FrozenConfig):
    type: Literal["icepop"] = "icepop"
    low: float = Field(0.5, gt=0, description="smallest kept token ratio")
    high: float = Field(5.0, gt=0, description="largest kept token ratio")

    def compute(
        self, train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
    ) -> corr.Correction:
        return corr.icepop(train_logprobs, rollout_logprobs, loss_mask, self.low, self.high)


class SequenceMISConfig(FrozenConfig):
    type: Literal["seq_mis"] = "seq_mis"
    cap: float = Field(gt=0, description="largest kept sequence ratio")

    def compute(
        self, train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
    ) -> corr.Correction:
        return corr.sequence_mis(train_logprobs, rollout_logprobs, loss_mask, self.cap)


class GeometricMISConfig(FrozenConfig):
    type: Literal["geo_mis"] = "geo_mis"
    low: float = Field(gt=0, description="smallest kept geometric-mean ratio")
    high: float = Field(gt=0, description="largest kept geometric-mean ratio")

    def compute(
        self, train_logprobs: Tensor, rollout_logprobs: Tensor, loss_mask: Tensor
    ) -> corr.Correction:
        return corr.geometric_mis(train_logprobs, rollout_logprobs, loss_mask, self.low, self.high)


CorrectionConfig = Annotated[
    Union[
        NoCorrectionConfig, TISConfig, IcePopConfig, SequenceMISConfig, GeometricMISConfig
    ],
    Field(discriminator="type"),
]


class KLConfig(FrozenConfig):
    """KL to the reference policy, as a per-token loss term or folded into the reward."""

    estimator: KLEstimator = "k3"
    coef: float = Field(ge=0, description="weight of the KL term")
    apply_to: Literal["loss", "reward"] = Field(
        description="add coef * KL to the loss, or subtract it from the reward"
    )
    max_log_ratio: float = Field(10.0, gt=0, description="clamp of log pi - log pi_ref, value only")

    def per_token(self, logprobs: Tensor, ref_logprobs: Tensor, loss_mask: Tensor) -> Tensor:
        return kl_penalty(logprobs, ref_logprobs, loss_mask, self.estimator, self.max_log_ratio)


class _Aggregation(FrozenConfig):
    """Aggregation modes; `type` is the mode name of aggregation.py."""

    def reduce(
        self,
        per_token_loss: Tensor,
        loss_mask: Tensor,
        global_num_tokens: int,
        global_num_seqs: int,
    ) -> Tensor:
        mode = self.type  # type: ignore[attr-defined]
        normalizer = getattr(self, "normalizer", None)
        return aggregate_loss(
            per_token_loss, loss_mask, mode, global_num_tokens, global_num_seqs, normalizer
        )


class TokenMeanConfig(_Aggregation):
    type: Literal["token_mean"] = "token_mean"


class SeqMeanTokenMeanConfig(_Aggregation):
    type: Literal["seq_mean_token_mean"] = "seq_mean_token_mean"


class SeqMeanTokenSumConfig(_Aggregation):
    type: Literal["seq_mean_token_sum"] = "seq_mean_token_sum"
    normalizer: float = Field(
        gt=0, description="constant divisor, e.g. the max generation length (Dr.GRPO)"
    )


AggregationConfig = Annotated[
    Union[TokenMeanConfig, SeqMeanTokenMeanConfig, SeqMeanTokenSumConfig],
    Field(discriminator="type"),
]
