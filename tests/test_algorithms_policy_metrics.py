"""Per-step metrics with explicit reductions (molt/algorithms/policy_metrics.py)."""

import math

import pytest

import torch
from torch.testing import assert_close

from molt.algorithms import (
    group_metrics,
    icepop,
    merge_token_metrics,
    policy_step_metrics,
    ppo_clip_loss,
)


def test_policy_step_metrics_match_hand_values():
    logprobs = torch.tensor([[0.5, -0.5, 0.0, 9.0]])
    rollout = torch.tensor([[0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False]])
    advantages = torch.tensor([[1.0, -1.0, 0.0, 5.0]])
    out = ppo_clip_loss(logprobs, rollout, advantages, mask, 0.2, 0.2)
    correction = icepop(logprobs, rollout, mask, low=0.5, high=1.5)  # e^0.5 = 1.65 dropped
    metrics = policy_step_metrics(
        mask, advantages, out, correction, logprobs, rollout,
        token_kl=torch.tensor([[0.3, 0.6, 0.0, 99.0]]), entropy=torch.tensor([[1.0, 2.0, 3.0, 99.0]]),
    )
    assert metrics["tokens/count"] == 3.0
    assert_close(metrics["advantage/mean"], 0.0)
    assert metrics["advantage/max"] == 1.0 and metrics["advantage/min"] == -1.0
    assert_close(metrics["advantage/zero_frac"], 1 / 3)
    assert_close(metrics["clip/high_frac"], 1 / 3)
    assert_close(metrics["clip/low_frac"], 1 / 3)
    assert_close(metrics["is/masked_frac"], 1 / 3)
    assert_close(metrics["is/weight_mean"], (math.exp(-0.5) + 1.0) / 2)
    assert_close(metrics["logprob_diff/abs_mean"], 1 / 3)
    assert metrics["logprob_diff/abs_max"] == 0.5
    assert_close(metrics["kl/mean"], 0.3)
    assert_close(metrics["entropy/mean"], 2.0)
    assert_close(metrics["ratio/max"], math.exp(0.5))
    # k3 of the ratio: (e^0.5 - 1 - 0.5 + e^-0.5 - 1 + 0.5) / 3
    assert_close(metrics["ppo_kl/mean"], (math.exp(0.5) + math.exp(-0.5) - 2) / 3)


def test_policy_step_metrics_of_an_empty_micro_batch_are_zero_not_nan():
    mask = torch.zeros(1, 2, dtype=torch.bool)
    metrics = policy_step_metrics(mask, torch.zeros(1, 2))
    assert all(value == 0.0 for value in metrics.values())


def test_merged_metrics_follow_each_keys_reduction():
    merged = merge_token_metrics([
        {"tokens/count": 1.0, "kl/mean": 0.2, "ratio/max": 1.1, "advantage/min": -1.0, "clip/high_frac": 1.0},
        {"tokens/count": 3.0, "kl/mean": 0.6, "ratio/max": 1.3, "advantage/min": -2.0, "clip/high_frac": 0.0},
    ])
    assert merged["tokens/count"] == 4.0
    assert_close(merged["kl/mean"], 0.5)
    assert merged["ratio/max"] == 1.3
    assert merged["advantage/min"] == -2.0
    assert merged["clip/high_frac"] == 0.25


def test_group_metrics_count_rollouts_once_and_flag_flat_and_truncated_groups():
    prompt_ids = ["p", "p", "p", "q", "q"]
    rollout_ids = ["a", "b", "b", "c", "d"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0])
    reasons = ["stop", "stop", "length", "length", "length"]
    metrics = group_metrics(prompt_ids, rollout_ids, rewards, reasons, torch.tensor([0.5, -0.5, -0.5, 0.0, 0.0]))
    assert metrics["rollouts/count"] == 4.0
    assert metrics["groups/count"] == 2.0
    assert metrics["reward/mean"] == 0.75
    assert metrics["rollouts/truncated_frac"] == 0.75
    assert metrics["groups/flat_frac"] == 0.5
    assert metrics["groups/all_truncated_frac"] == 0.5
    assert metrics["advantage/abs_max"] == 0.5


def test_group_metrics_of_an_empty_batch_are_zero_not_nan():
    metrics = group_metrics([], [], torch.zeros(0), [])
    assert all(value == 0.0 for value in metrics.values())


def test_group_metrics_refuse_finish_reasons_of_the_wrong_length():
    with pytest.raises(ValueError, match="finish_reasons"):
        group_metrics(["p", "p"], ["a", "b"], torch.zeros(2), ["stop"])
