"""Policy losses on tiny hand-computed examples (molt/algorithms/losses.py)."""

import math

import pytest
import torch
from torch.testing import assert_close

from molt.algorithms import aggregate_loss, cispo_loss, gspo_loss, policy_step_metrics, ppo_clip_loss


def _leaf(values):
    return torch.tensor(values, requires_grad=True)


def test_first_on_policy_step_has_unit_ratios_no_clipping_and_zero_ppo_kl():
    rollout = torch.tensor([[-0.3, -1.7, -2.2], [-0.9, -0.1, 0.0]])
    logprobs = rollout.clone().requires_grad_(True)
    mask = torch.tensor([[True, True, True], [True, True, False]])
    advantages = torch.tensor([[1.0, 1.0, 1.0], [-1.0, -1.0, 0.0]])
    out = ppo_clip_loss(logprobs, rollout, advantages, mask, clip_low=0.2, clip_high=0.28, dual_clip=3.0)
    assert torch.equal(out.ratio, torch.ones(2, 3))
    metrics = policy_step_metrics(mask, advantages, out, train_logprobs=logprobs, rollout_logprobs=rollout)
    assert metrics["clip/low_frac"] == 0.0
    assert metrics["clip/high_frac"] == 0.0
    assert metrics["clip/dual_frac"] == 0.0
    assert metrics["ppo_kl/mean"] == 0.0
    assert metrics["logprob_diff/abs_max"] == 0.0


def test_ppo_clip_higher_is_asymmetric():
    # log ratio 0.25: r = 1.2840; clipped at 1.28 for A > 0 (clip_high 0.28)
    # log ratio -0.25: r = 0.7788; clipped at 0.8 for A < 0 (clip_low 0.2)
    logprobs = _leaf([[0.25, -0.25, 0.1]])
    out = ppo_clip_loss(logprobs, torch.zeros(1, 3), torch.tensor([[1.0, -1.0, 1.0]]),
                        torch.ones(1, 3, dtype=torch.bool), clip_low=0.2, clip_high=0.28)
    assert_close(out.per_token_loss, torch.tensor([[-1.28, 0.8, -math.exp(0.1)]]))
    assert out.clipped_high.tolist() == [[True, False, False]]
    assert out.clipped_low.tolist() == [[False, True, False]]
    out.per_token_loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, -math.exp(0.1)]]))


def test_dual_clip_caps_the_loss_of_negative_advantages_with_exploded_ratio():
    logprobs = _leaf([[2.0, 2.0, 0.5]])
    old = torch.zeros(1, 3)
    advantages = torch.tensor([[-1.0, 1.0, -1.0]])
    mask = torch.ones(1, 3, dtype=torch.bool)
    plain = ppo_clip_loss(logprobs, old, advantages, mask, 0.2, 0.2)
    assert_close(plain.per_token_loss, torch.tensor([[math.exp(2.0), -1.2, math.exp(0.5)]]))
    dual = ppo_clip_loss(logprobs, old, advantages, mask, 0.2, 0.2, dual_clip=3.0)
    # e^2 = 7.389 > 3 is capped at 3 |A|; e^0.5 = 1.6487 < 3 and A > 0 are untouched
    assert_close(dual.per_token_loss, torch.tensor([[3.0, -1.2, math.exp(0.5)]]))
    assert dual.dual_clipped.tolist() == [[True, False, False]]
    dual.per_token_loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.0, 0.0, math.exp(0.5)]]))


def test_ppo_rejects_a_dual_clip_not_above_one():
    with pytest.raises(ValueError, match="dual_clip must be > 1"):
        one = torch.ones(1, 1, dtype=torch.bool)
        ppo_clip_loss(torch.zeros(1, 1), torch.zeros(1, 1), torch.ones(1, 1), one, dual_clip=0.5)


def test_gspo_clips_the_sequence_geometric_ratio():
    logprobs = _leaf([[0.1, -0.1, 0.3], [0.2, 0.4, 0.0]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    advantages = torch.tensor([[2.0, 2.0, 2.0], [-1.0, -1.0, -1.0]])
    out = gspo_loss(logprobs, torch.zeros(2, 3), advantages, mask, clip_low=0.2, clip_high=0.2)
    # row 0: s = exp(0) = 1, loss -2 on valid tokens; row 1: s = exp(0.2) = 1.2214 > 1.2,
    # but A < 0 so the unclipped term wins: loss = s * 1
    s1 = math.exp(0.2)
    assert_close(out.per_token_loss, torch.tensor([[-2.0, -2.0, 0.0], [s1, s1, s1]]))
    assert_close(out.ratio, torch.tensor([[1.0, 1.0, 1.0], [s1, s1, s1]]))
    loss = aggregate_loss(out.per_token_loss, mask, "seq_mean_token_mean", 5, 2)
    loss.backward()
    # GSPO gradient: -A * s / |y| / num_seqs on each token
    assert_close(logprobs.grad, torch.tensor([[-0.5, -0.5, 0.0], [s1 / 6, s1 / 6, s1 / 6]]))


def test_gspo_paper_clip_range_clips_a_small_drift():
    out = gspo_loss(_leaf([[0.1, 0.3]]), torch.zeros(1, 2), torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool))
    assert_close(out.per_token_loss, torch.tensor([[-1.0004, -1.0004]]))
    assert out.clipped_high.all()


def test_cispo_keeps_gradient_of_clipped_tokens_with_capped_weight():
    logprobs = _leaf([[-1.0, -2.0]])
    old = torch.tensor([[-1.0, -3.0]])  # ratios [1, e]
    out = cispo_loss(logprobs, old, torch.ones(1, 2), torch.ones(1, 2, dtype=torch.bool), clip_high=0.5)
    assert_close(out.per_token_loss, torch.tensor([[1.0, 3.0]]))
    assert out.clipped_high.tolist() == [[False, True]]
    out.per_token_loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[-1.0, -1.5]]))


def test_cispo_lower_clip_raises_small_weights():
    logprobs = _leaf([[-2.0]])
    out = cispo_loss(logprobs, torch.tensor([[-1.0]]), torch.tensor([[-1.0]]),
                     torch.ones(1, 1, dtype=torch.bool), clip_high=0.5, clip_low=0.2)
    # ratio e^-1 = 0.3679 raised to 0.8; loss = -0.8 * (-1) * (-2)
    assert_close(out.per_token_loss, torch.tensor([[-1.6]]))
    out.per_token_loss.sum().backward()
    assert_close(logprobs.grad, torch.tensor([[0.8]]))


def test_all_masked_policy_loss_is_zero_with_zero_gradient_even_on_garbage():
    logprobs = _leaf([[-math.inf, 50.0]])
    mask = torch.zeros(1, 2, dtype=torch.bool)
    for out in (
        ppo_clip_loss(logprobs, torch.tensor([[0.0, -50.0]]), torch.ones(1, 2), mask, dual_clip=3.0),
        gspo_loss(logprobs, torch.tensor([[0.0, -50.0]]), torch.ones(1, 2), mask),
        cispo_loss(logprobs, torch.tensor([[0.0, -50.0]]), torch.ones(1, 2), mask, clip_high=0.3),
    ):
        assert torch.equal(out.per_token_loss, torch.zeros(1, 2))
        logprobs.grad = None
        aggregate_loss(out.per_token_loss, mask, "token_mean", 0, 0).backward()
        assert torch.equal(logprobs.grad, torch.zeros(1, 2))
