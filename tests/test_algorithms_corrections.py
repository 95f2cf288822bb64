"""Off-policy corrections between rollout and trainer logprobs (molt/algorithms/corrections.py)."""

import math

import torch
from torch.testing import assert_close

from molt.algorithms import (
    aggregate_loss,
    apply_correction,
    decoupled_ppo_loss,
    geometric_mis,
    icepop,
    policy_step_metrics,
    ppo_clip_loss,
    sequence_mis,
    truncated_is,
)

ALL3 = torch.ones(1, 3, dtype=torch.bool)


def test_masked_overflowing_is_ratio_contributes_nothing_and_no_nan():
    # the trainer anchors PPO on the rollout; token 1 has log ratio 89 (exp = inf in fp32)
    logprobs = torch.tensor([[-1.0, -0.5, -1.0]], requires_grad=True)
    rollout = torch.tensor([[-1.1, -89.5, -0.9]])
    assert torch.isinf((logprobs.detach() - rollout).exp()).any()
    correction = icepop(logprobs, rollout, ALL3, low=0.5, high=5.0)
    assert correction.keep.tolist() == [[True, False, True]]
    out = ppo_clip_loss(logprobs, rollout, torch.ones(1, 3), correction.keep, 0.2, 0.2)
    per_token = apply_correction(out.per_token_loss, correction)
    loss = aggregate_loss(per_token, ALL3, "token_mean", 3, 1)
    loss.backward()
    # kept tokens: ratio = weight = e^{+-0.1}, loss -r * w = -e^{+-0.2}; token 1 gives 0
    assert_close(loss, torch.tensor(-(math.exp(0.2) + math.exp(-0.2)) / 3))
    assert_close(logprobs.grad, torch.tensor([[-math.exp(0.2) / 3, 0.0, -math.exp(-0.2) / 3]]))
    assert logprobs.grad[0, 1].item() == 0.0
    assert torch.isfinite(per_token).all() and torch.isfinite(logprobs.grad).all()
    metrics = policy_step_metrics(ALL3, torch.ones(1, 3), out, correction, logprobs, rollout)
    assert_close(metrics["is/masked_frac"], 1 / 3)
    assert_close(metrics["logprob_diff/abs_max"], 89.0)


def test_truncated_is_caps_an_overflowing_ratio_without_inf():
    correction = truncated_is(torch.tensor([[0.0, 89.0, -1.0]]), torch.zeros(1, 3), ALL3, cap=2.0)
    assert_close(correction.weight, torch.tensor([[1.0, 2.0, math.exp(-1.0)]]))
    assert correction.keep.all()


def test_truncated_is_drops_tokens_with_non_finite_log_ratio():
    correction = truncated_is(torch.tensor([[-math.inf, math.nan, 0.0]]), torch.zeros(1, 3), ALL3, cap=2.0)
    assert correction.keep.tolist() == [[False, False, True]]
    assert torch.equal(correction.weight, torch.tensor([[0.0, 0.0, 1.0]]))


def test_icepop_weights_inside_the_band_and_drops_outside():
    train = torch.tensor([[0.0, math.log(4.0), math.log(0.25)]])
    correction = icepop(train, torch.zeros(1, 3), ALL3, low=0.5, high=5.0)
    assert_close(correction.weight, torch.tensor([[1.0, 4.0, 0.0]]))
    assert correction.keep.tolist() == [[True, True, False]]


def test_sequence_mis_rejects_whole_rows_above_the_cap():
    train = torch.tensor([[0.1, 0.2, 5.0], [1.0, 1.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    correction = sequence_mis(train, torch.zeros(2, 3), mask, cap=2.0)
    rho = math.exp(0.3)  # the masked 5.0 does not count
    assert_close(correction.weight, torch.tensor([[rho, rho, 0.0], [0.0, 0.0, 0.0]]))
    assert correction.keep.tolist() == [[True, True, False], [False, False, False]]


def test_geometric_mis_filters_rows_by_mean_log_ratio():
    train = torch.tensor([[0.1, -0.1], [0.5, 0.7]])
    correction = geometric_mis(train, torch.zeros(2, 2), torch.ones(2, 2, dtype=torch.bool), low=0.5, high=1.5)
    assert torch.equal(correction.weight, torch.tensor([[1.0, 1.0], [0.0, 0.0]]))


def test_decoupled_ppo_anchors_the_clip_on_the_proximal_policy():
    logprobs = torch.tensor([[0.3, 0.0]], requires_grad=True)
    proximal = torch.tensor([[0.0, 0.0]])
    rollout = torch.tensor([[-0.5, 0.0]])  # behaviour weight e^0.5 on token 0
    mask = torch.ones(1, 2, dtype=torch.bool)
    out = decoupled_ppo_loss(logprobs, proximal, rollout, torch.ones(1, 2), mask, 0.2, 0.2)
    # token 0: r = e^0.3 = 1.35 clipped to 1.2 (around the proximal, not the rollout),
    # times e^0.5; token 1: r = 1, weight 1
    assert_close(out.per_token_loss, torch.tensor([[-1.2 * math.exp(0.5), -1.0]]))
    out.per_token_loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, -1.0]]))


def test_decoupled_ppo_with_fresh_data_equals_ppo():
    logprobs = torch.tensor([[0.1, -0.3]])
    proximal = torch.tensor([[0.0, 0.0]])
    mask = torch.ones(1, 2, dtype=torch.bool)
    advantages = torch.tensor([[1.0, -1.0]])
    decoupled = decoupled_ppo_loss(logprobs, proximal, proximal, advantages, mask, behaviour_cap=2.0)
    plain = ppo_clip_loss(logprobs, proximal, advantages, mask)
    assert torch.equal(decoupled.per_token_loss, plain.per_token_loss)
