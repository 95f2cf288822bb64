"""Pure tensor functions of RL for language models: advantages, losses, corrections,
KL, aggregation, DAPO extras and metrics. No I/O, no global state, any device.

Conventions, which each function's docstring states only where it departs:
- per-token tensors are padded [B, T] (B rows, T tokens) with a bool `loss_mask`
  [B, T], true exactly on generated tokens; every [B, T] output is exactly 0, with
  0 gradient, off the mask, even where the inputs hold NaN or inf;
- empty input ([0], [0, T], [B, 0]) keeps its shape, all-masked input gives zeros
  with zero gradient, and a metric of either is 0.0, never NaN;
- groups come from the columns `prompt_id`, `rollout_id` as Python lists (groups.py).
"""

from molt.algorithms.advantage_configs import (
    AdvantageConfig,
    AdvantageInputs,
    DistillationConfig,
    DrGRPOConfig,
    GAEConfig,
    GRPOConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    RLOOConfig,
)
from molt.algorithms.advantages import (
    dr_grpo_advantages,
    grpo_advantages,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    row_advantages,
)
from molt.algorithms.aggregation import aggregate_loss, count_loss_tokens
from molt.algorithms.corrections import (
    Correction,
    apply_correction,
    decoupled_ppo_loss,
    geometric_mis,
    icepop,
    no_correction,
    sequence_mis,
    truncated_is,
)
from molt.algorithms.dapo import (
    GroupSelection,
    entropy_bonus,
    is_flat,
    overlong_penalty,
    select_informative_groups,
    token_entropy,
)
from molt.algorithms.groups import (
    GroupStats,
    RolloutIndex,
    group_stats,
    index_rollouts,
    rows_to_tokens,
)
from molt.algorithms.kl import fold_kl_into_rewards, kl_penalty
from molt.algorithms.loss_configs import (
    AggregationConfig,
    CISPOLossConfig,
    CorrectionConfig,
    GeometricMISConfig,
    GSPOLossConfig,
    IcePopConfig,
    KLConfig,
    NoCorrectionConfig,
    PolicyLossConfig,
    PPOLossConfig,
    SeqMeanTokenMeanConfig,
    SeqMeanTokenSumConfig,
    SequenceMISConfig,
    TISConfig,
    TokenMeanConfig,
)
from molt.algorithms.losses import (
    PolicyLoss,
    cispo_loss,
    gspo_loss,
    masked_log_ratio,
    ppo_clip_loss,
)
from molt.algorithms.masks import completion_loss_mask
from molt.algorithms.policy_metrics import group_metrics, merge_token_metrics, policy_step_metrics
from molt.algorithms.token_advantages import (
    distillation_advantages,
    gae_advantages,
    outcome_token_rewards,
)

__all__ = [name for name in dir() if not name.startswith("_")]
