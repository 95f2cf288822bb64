"""KL estimators against a reference policy (molt/algorithms/kl.py)."""

import math

import pytest
import torch
from torch.testing import assert_close

from molt.algorithms import fold_kl_into_rewards, kl_penalty

ONE = torch.ones(1, 1, dtype=torch.bool)


@pytest.mark.parametrize(
    "estimator, value, gradient",
    [
        ("k1", 0.5, 1.0),
        ("k2", 0.125, 0.5),
        ("k3", math.exp(-0.5) - 0.5, 1 - math.exp(-0.5)),  # 0.106531, 0.393469
    ],
)
def test_kl_estimators_match_hand_values_for_log_ratio_one_half(estimator, value, gradient):
    logprobs = torch.tensor([[-1.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([[-1.5]]), ONE, estimator)
    kl.sum().backward()
    assert_close(kl, torch.tensor([[value]]))
    assert_close(logprobs.grad, torch.tensor([[gradient]]))


def test_k3_kl_of_far_policy_is_capped_with_finite_gradient():
    logprobs = torch.tensor([[-100.0]], requires_grad=True)
    kl = kl_penalty(logprobs, torch.tensor([[0.0]]), ONE, "k3", max_log_ratio=10.0)
    kl.sum().backward()
    # d = -100 clamped to -10: exp(10) - 1 - 10 = 22015.4658; gradient 1 - exp(10)
    assert_close(kl, torch.tensor([[math.exp(10.0) - 11.0]]))
    assert_close(logprobs.grad, torch.tensor([[1.0 - math.exp(10.0)]]))
    assert torch.isfinite(kl).all() and torch.isfinite(logprobs.grad).all()


def test_kl_is_zero_with_zero_gradient_off_mask_even_for_infinite_logprobs():
    logprobs = torch.tensor([[-math.inf, -1.0]], requires_grad=True)
    mask = torch.tensor([[False, True]])
    kl = kl_penalty(logprobs, torch.tensor([[0.0, -1.0]]), mask, "k3")
    kl.sum().backward()
    assert torch.equal(kl, torch.zeros(1, 2))
    assert torch.equal(logprobs.grad, torch.tensor([[0.0, 0.0]]))


def test_unknown_kl_estimator_is_refused():
    with pytest.raises(ValueError, match="unknown KL estimator"):
        kl_penalty(torch.zeros(1, 1), torch.zeros(1, 1), ONE, "k4")  # type: ignore[arg-type]


def test_kl_folded_into_rewards_subtracts_the_scaled_sequence_sum():
    rewards = fold_kl_into_rewards(torch.tensor([1.0, 0.0]), torch.tensor([[0.1, 0.2], [0.0, 0.5]]), coef=0.1)
    assert_close(rewards, torch.tensor([0.97, -0.05]))
