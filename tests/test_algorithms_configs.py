"""Selecting algorithms by YAML `type:` through pydantic configs (advantage_configs.py, loss_configs.py)."""

import pytest
import torch
import yaml
from pydantic import TypeAdapter, ValidationError
from torch.testing import assert_close

from molt.algorithms import (
    AdvantageConfig,
    AdvantageInputs,
    AggregationConfig,
    CISPOLossConfig,
    CorrectionConfig,
    IcePopConfig,
    KLConfig,
    PolicyLossConfig,
    PPOLossConfig,
    RLOOConfig,
    SeqMeanTokenSumConfig,
)

ADVANTAGE = TypeAdapter(AdvantageConfig)
POLICY_LOSS = TypeAdapter(PolicyLossConfig)


def _inputs(**extra):
    return AdvantageInputs(
        prompt_ids=["p"] * 4, rollout_ids=["a", "b", "c", "d"],
        rewards=torch.tensor([1.0, 0.0, 0.0, 0.5]),
        loss_mask=torch.tensor([[1, 1], [1, 0], [1, 1], [0, 0]], dtype=torch.bool), **extra,
    )


def test_yaml_type_selects_the_advantage_estimator():
    config = ADVANTAGE.validate_python(yaml.safe_load("type: rloo"))
    assert isinstance(config, RLOOConfig)
    advantages = config.compute(_inputs())
    assert_close(advantages, torch.tensor([[5 / 6, 5 / 6], [-0.5, 0.0], [-0.5, -0.5], [0.0, 0.0]]))


def test_every_advantage_type_builds_from_its_tag():
    for tag in ("grpo", "dr_grpo", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae", "distillation"):
        assert ADVANTAGE.validate_python({"type": tag}).type == tag


def test_unknown_type_and_unknown_key_fail_at_load():
    with pytest.raises(ValidationError, match="grpo"):
        ADVANTAGE.validate_python({"type": "gpro"})
    with pytest.raises(ValidationError, match="epss"):
        ADVANTAGE.validate_python({"type": "grpo", "epss": 1e-6})


def test_distillation_without_teacher_logprobs_names_the_missing_column():
    config = ADVANTAGE.validate_python({"type": "distillation"})
    with pytest.raises(ValueError, match="teacher_logprobs"):
        config.compute(_inputs(rollout_logprobs=torch.zeros(4, 2)))


def test_gae_refuses_multi_segment_rollouts():
    config = ADVANTAGE.validate_python({"type": "gae"})
    inputs = AdvantageInputs(["p", "p"], ["a", "a"], torch.tensor([1.0, 1.0]),
                             torch.ones(2, 2, dtype=torch.bool), values=torch.zeros(2, 2))
    with pytest.raises(ValueError, match="one row per rollout"):
        config.compute(inputs)


def test_gae_config_places_the_reward_at_the_end_and_runs_gae():
    config = ADVANTAGE.validate_python({"type": "gae", "gamma": 1.0, "lam": 1.0})
    inputs = AdvantageInputs(["p"], ["a"], torch.tensor([1.0]), torch.tensor([[True, True, False]]),
                             values=torch.tensor([[0.25, 0.5, 0.0]]))
    assert_close(config.compute(inputs), torch.tensor([[0.75, 0.5, 0.0]]))


def test_policy_loss_configs_validate_clip_ranges_and_call_their_function():
    config = POLICY_LOSS.validate_python({"type": "ppo", "clip_high": 0.28, "dual_clip": 3.0})
    assert isinstance(config, PPOLossConfig)
    one = torch.ones(1, 1, dtype=torch.bool)
    out = config.compute(torch.tensor([[0.5]]), torch.zeros(1, 1), torch.ones(1, 1), one)
    assert_close(out.per_token_loss, torch.tensor([[-1.28]]))
    with pytest.raises(ValidationError):
        POLICY_LOSS.validate_python({"type": "ppo", "clip_low": 1.5})
    with pytest.raises(ValidationError, match="clip_high"):
        POLICY_LOSS.validate_python({"type": "cispo"})
    assert isinstance(POLICY_LOSS.validate_python({"type": "cispo", "clip_high": 4.0}), CISPOLossConfig)


def test_correction_kl_and_aggregation_configs_build_from_yaml():
    correction = TypeAdapter(CorrectionConfig).validate_python({"type": "icepop"})
    assert isinstance(correction, IcePopConfig) and (correction.low, correction.high) == (0.5, 5.0)
    kept = correction.compute(torch.tensor([[0.0, 3.0]]), torch.zeros(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert kept.keep.tolist() == [[True, False]]
    kl = KLConfig(coef=0.001, apply_to="loss")
    one = torch.ones(1, 1, dtype=torch.bool)
    assert_close(kl.per_token(torch.tensor([[-1.0]]), torch.tensor([[-1.5]]), one), torch.tensor([[0.106531]]))
    aggregation = TypeAdapter(AggregationConfig).validate_python({"type": "seq_mean_token_sum", "normalizer": 4})
    assert isinstance(aggregation, SeqMeanTokenSumConfig)
    loss = aggregation.reduce(torch.ones(2, 4), torch.ones(2, 4, dtype=torch.bool), 8, 2)
    assert loss.item() == 1.0
    with pytest.raises(ValidationError, match="normalizer"):
        TypeAdapter(AggregationConfig).validate_python({"type": "seq_mean_token_sum"})
