"""DAPO extras and the completion loss mask (molt/algorithms/dapo.py, masks.py)."""

import math

import pytest
import torch
from torch.testing import assert_close

from molt.algorithms import (
    completion_loss_mask,
    entropy_bonus,
    overlong_penalty,
    select_informative_groups,
    token_entropy,
)

EOS = 2


def test_pad_equal_to_eos_masks_only_the_generated_eos():
    mask = completion_loss_mask(torch.tensor([[5, 6, EOS, EOS, EOS]]), eos_id=EOS)
    assert mask.tolist() == [[True, True, True, False, False]]


def test_completion_without_eos_is_all_generated_and_immediate_eos_is_one_token():
    mask = completion_loss_mask(torch.tensor([[7, 8, 9], [EOS, EOS, EOS]]), eos_id=EOS)
    assert mask.tolist() == [[True, True, True], [True, False, False]]


def test_generated_length_expresses_a_zero_length_completion():
    mask = completion_loss_mask(torch.tensor([[5, 6, EOS], [EOS, EOS, EOS]]), EOS, torch.tensor([3, 0]))
    assert mask.tolist() == [[True, True, True], [False, False, False]]


def test_dynamic_sampling_drops_flat_groups_and_holds_the_surplus():
    groups = [[1, 0], [1, 1], [0, 0, 1], [0.5, 0.5], [0, 1]]
    selection = select_informative_groups(groups, num_groups_per_step=2)
    assert selection.keep == [0, 2]
    assert selection.surplus == [4]
    assert selection.dropped == [1, 3]
    assert selection.num_more_needed == 0


def test_dynamic_sampling_asks_for_more_groups_when_too_few_are_informative():
    selection = select_informative_groups([[1, 0], [1, 1], [0.35] * 7, [0, 1]], num_groups_per_step=4)
    assert selection.keep == [0, 3]
    assert selection.dropped == [1, 2]
    assert selection.num_more_needed == 2


def test_dynamic_sampling_of_segment_rows_judges_flatness_per_rollout():
    # a 4-segment failure repeats its reward; the group is still informative
    assert select_informative_groups([[1, 0, 0, 0, 0]], 1).keep == [0]


def test_dynamic_sampling_refuses_a_zero_target():
    with pytest.raises(ValueError, match="num_groups_per_step"):
        select_informative_groups([[1, 0]], 0)


def test_overlong_penalty_ramps_linearly_inside_the_cache():
    lengths = torch.tensor([10, 16, 17, 18, 20, 25])
    penalty = overlong_penalty(lengths, max_length=20, cache_length=4)
    assert torch.equal(penalty, torch.tensor([0.0, 0.0, -0.25, -0.5, -1.0, -1.0]))


def test_overlong_penalty_refuses_a_cache_longer_than_the_limit():
    with pytest.raises(ValueError, match="cache_length"):
        overlong_penalty(torch.tensor([1]), max_length=4, cache_length=8)


def test_token_entropy_of_uniform_and_masked_vocabularies():
    logits = torch.tensor([[[0.0, 0.0, -math.inf], [0.0, -math.inf, -math.inf]]])
    assert_close(token_entropy(logits), torch.tensor([[math.log(2.0), 0.0]]))


def test_entropy_bonus_is_negative_scaled_entropy_on_valid_tokens():
    bonus = entropy_bonus(torch.tensor([[0.7, 0.1]]), torch.tensor([[True, False]]), coef=0.01)
    assert_close(bonus, torch.tensor([[-0.007, 0.0]]))
