"""Advantage estimators on hand-computed examples (molt/algorithms/advantages.py, token_advantages.py)."""

import math

import pytest
import torch
from torch.testing import assert_close

from molt.algorithms import (
    distillation_advantages,
    dr_grpo_advantages,
    gae_advantages,
    group_metrics,
    grpo_advantages,
    index_rollouts,
    outcome_token_rewards,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    row_advantages,
    rows_to_tokens,
)


def test_grpo_all_equal_rewards_give_exact_zero_advantages():
    rewards = torch.full((7,), 0.35)
    group_ids = torch.zeros(7, dtype=torch.long)
    # fp32 really does produce a tiny non-zero std here; naive GRPO would give ~0.029
    assert rewards.std().item() != 0.0
    advantages = grpo_advantages(rewards, group_ids)
    assert torch.equal(advantages, torch.zeros(7))


def test_every_estimator_gives_exact_zero_for_a_flat_group():
    rewards = torch.tensor([0.35] * 7 + [1.0, 0.0])
    group_ids = torch.tensor([0] * 7 + [1, 1])
    estimators = (grpo_advantages, dr_grpo_advantages, rloo_advantages, reinforce_pp_baseline_advantages)
    for estimator in estimators:
        assert torch.equal(estimator(rewards, group_ids)[:7], torch.zeros(7)), estimator.__name__


def test_grpo_fully_truncated_group_gives_zero_advantages_and_reports_truncation():
    prompt_ids, rollout_ids = ["p"] * 4, ["a", "b", "c", "d"]
    rewards = torch.tensor([1.0, 1.0, 1.0, 1.0])
    advantages = row_advantages(grpo_advantages, prompt_ids, rollout_ids, rewards)
    assert torch.equal(advantages, torch.zeros(4))
    metrics = group_metrics(prompt_ids, rollout_ids, rewards, ["length"] * 4)
    assert metrics["groups/all_truncated_frac"] == 1.0
    assert metrics["rollouts/truncated_frac"] == 1.0
    assert metrics["groups/flat_frac"] == 1.0


def test_grpo_two_prompts_three_samples_match_hand_values():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5, 0.5, 0.5])
    group_ids = torch.tensor([0, 0, 0, 1, 1, 1])
    # mean 1/3, Bessel std sqrt(1/3); (2/3) / 0.57735 = 1.154700
    expected = torch.tensor([1.154700, -0.577350, -0.577350, 0.0, 0.0, 0.0])
    assert_close(grpo_advantages(rewards, group_ids), expected, atol=1e-5, rtol=0)


def test_dr_grpo_subtracts_the_group_mean_only():
    rewards = torch.tensor([1.0, 0.0, 0.0, 2.0, 4.0])
    group_ids = torch.tensor([0, 0, 0, 1, 1])
    expected = torch.tensor([2 / 3, -1 / 3, -1 / 3, -1.0, 1.0])
    assert_close(dr_grpo_advantages(rewards, group_ids), expected)


def test_rloo_uses_the_mean_of_the_other_samples():
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.5])
    group_ids = torch.zeros(4, dtype=torch.long)
    # baselines (1.5 - r_i) / 3 = [1/6, 1/2, 1/2, 1/3]
    expected = torch.tensor([5 / 6, -0.5, -0.5, 1 / 6])
    assert_close(rloo_advantages(rewards, group_ids), expected)


def test_rloo_single_sample_group_has_zero_advantage():
    assert torch.equal(rloo_advantages(torch.tensor([3.0]), torch.tensor([0])), torch.zeros(1))


def test_reinforce_pp_whitens_over_the_batch_ignoring_groups():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    # batch mean 0.75, Bessel std 0.5
    expected = torch.tensor([0.5, -1.5, 0.5, 0.5])
    assert_close(reinforce_pp_advantages(rewards, group_ids), expected, atol=1e-5, rtol=0)


def test_reinforce_pp_baseline_centres_by_group_then_scales_by_batch_std():
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    group_ids = torch.tensor([0, 0, 1, 1])
    # centred [0.5, -0.5, 0, 0], batch std sqrt(0.5 / 3) = 0.408248
    expected = torch.tensor([1.224745, -1.224745, 0.0, 0.0])
    assert_close(reinforce_pp_baseline_advantages(rewards, group_ids), expected, atol=1e-5, rtol=0)


def test_multi_segment_failure_counts_once_in_group_baseline():
    # one episode wins in 1 turn (1 row), one fails in 4 turns (4 segment rows)
    prompt_ids = ["p"] * 5
    rollout_ids = ["win", "lose", "lose", "lose", "lose"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 0.0, 0.0])
    index = index_rollouts(prompt_ids, rollout_ids, rewards)
    assert index.rollout_rewards.mean().item() == 0.5
    advantages = row_advantages(dr_grpo_advantages, prompt_ids, rollout_ids, rewards)
    assert torch.equal(advantages, torch.tensor([0.5, -0.5, -0.5, -0.5, -0.5]))


def test_segments_of_one_rollout_with_different_rewards_are_refused():
    with pytest.raises(ValueError, match="share one reward"):
        index_rollouts(["p", "p"], ["a", "a"], torch.tensor([1.0, 0.0]))


def test_mismatched_column_lengths_are_refused():
    with pytest.raises(ValueError, match="one entry per row"):
        index_rollouts(["p", "p"], ["a"], torch.tensor([1.0, 0.0]))


def test_zero_length_completion_keeps_its_own_reward_and_adds_no_advantage():
    """Decision: an empty completion is a rollout like any other. Its reward (here
    0, as graded) counts once in its group, stays in its own row, and with no
    loss token it carries no advantage and so adds nothing to the loss."""
    prompt_ids, rollout_ids = ["p"] * 4, ["a", "b", "empty", "d"]
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])
    loss_mask = torch.tensor([[1, 1, 1], [1, 1, 0], [0, 0, 0], [1, 1, 0]], dtype=torch.bool)
    rows = row_advantages(grpo_advantages, prompt_ids, rollout_ids, rewards)
    # mean 0.5, Bessel std sqrt(1/3): +-0.5 / 0.57735 = +-0.866025
    assert_close(rows, torch.tensor([0.866025, -0.866025, -0.866025, 0.866025]), atol=1e-5, rtol=0)
    tokens = rows_to_tokens(rows, loss_mask)
    assert torch.equal(tokens[2], torch.zeros(3))
    # reordering rows moves each advantage with its own row, never into another slot
    order = [2, 0, 3, 1]
    shuffled_prompts = [prompt_ids[i] for i in order]
    shuffled_rollouts = [rollout_ids[i] for i in order]
    shuffled = row_advantages(grpo_advantages, shuffled_prompts, shuffled_rollouts, rewards[order])
    assert torch.equal(shuffled, rows[order])


def test_outcome_reward_lands_on_the_last_generated_token():
    loss_mask = torch.tensor([[1, 1, 0], [0, 1, 1], [0, 0, 0]], dtype=torch.bool)
    placed = outcome_token_rewards(torch.tensor([1.0, 2.0, 3.0]), loss_mask)
    assert torch.equal(placed, torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 2.0], [0.0, 0.0, 0.0]]))


def test_gae_matches_hand_computed_recursion():
    advantages, returns = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
        torch.ones(1, 3, dtype=torch.bool), gamma=0.9, lam=0.5,
    )
    # delta = [0.04, 0.03, 0.3]; A2 = 0.3, A1 = 0.03 + 0.45 * 0.3, A0 = 0.04 + 0.45 * 0.165
    assert_close(advantages, torch.tensor([[0.11425, 0.165, 0.3]]))
    assert_close(returns, torch.tensor([[0.61425, 0.765, 1.0]]))


def test_gae_skips_tool_tokens_between_generated_tokens():
    advantages, returns = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 9.9, 0.7]]),
        torch.tensor([[True, False, True]]), gamma=0.9, lam=0.5,
    )
    # the tool token (value 9.9) is invisible: delta0 = 0.9 * 0.7 - 0.5 = 0.13
    assert_close(advantages, torch.tensor([[0.265, 0.0, 0.3]]))
    assert_close(returns, torch.tensor([[0.765, 0.0, 1.0]]))


def test_gae_with_gamma_and_lambda_one_is_monte_carlo_return_minus_value():
    advantages, _ = gae_advantages(
        torch.tensor([[0.0, 0.0, 1.0]]), torch.tensor([[0.5, 0.6, 0.7]]),
        torch.ones(1, 3, dtype=torch.bool), gamma=1.0, lam=1.0,
    )
    assert_close(advantages, torch.tensor([[0.5, 0.4, 0.3]]))


def test_distillation_advantage_is_negative_scaled_reverse_kl_per_token():
    student = torch.tensor([[-1.0, -2.0, -math.inf]])
    teacher = torch.tensor([[-0.5, -3.0, -math.inf]])
    mask = torch.tensor([[True, True, False]])
    advantages = distillation_advantages(student, teacher, mask, beta=2.0)
    assert torch.equal(advantages, torch.tensor([[1.0, -2.0, 0.0]]))


def test_empty_batch_gives_empty_advantages():
    empty = torch.zeros(0)
    assert row_advantages(grpo_advantages, [], [], empty).shape == (0,)
