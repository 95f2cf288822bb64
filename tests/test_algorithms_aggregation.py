"""Loss aggregation and its invariance to micro-batch and rank splits (molt/algorithms/aggregation.py)."""

import pytest
import torch
from torch.testing import assert_close

from molt.algorithms import aggregate_loss, count_loss_tokens

MODES = ["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]


def test_token_mean_ignores_a_fully_masked_completion():
    per_token = torch.ones(2, 6)
    mask = torch.tensor([[1, 1, 1, 1, 0, 0], [0, 0, 0, 0, 0, 0]], dtype=torch.bool)
    num_tokens, num_seqs = count_loss_tokens(mask)
    assert (num_tokens, num_seqs) == (4, 1)
    assert aggregate_loss(per_token, mask, "token_mean", num_tokens, num_seqs).item() == 1.0


def test_token_mean_selects_valid_tokens_and_gives_half_gradient_each():
    per_token = torch.tensor([[1.0, 100.0], [1.0, -50.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [True, False]])
    loss = aggregate_loss(per_token, mask, "token_mean", 2, 2)
    loss.backward()
    assert loss.item() == 1.0
    assert torch.equal(per_token.grad, torch.tensor([[0.5, 0.0], [0.5, 0.0]]))


def test_masked_infinite_losses_do_not_leak():
    per_token = torch.tensor([[2.0, float("inf")], [float("nan"), 4.0]], requires_grad=True)
    mask = torch.tensor([[True, False], [False, True]])
    loss = aggregate_loss(per_token, mask, "token_mean", 2, 2)
    loss.backward()
    assert loss.item() == 3.0
    assert torch.equal(per_token.grad, torch.tensor([[0.5, 0.0], [0.0, 0.5]]))


@pytest.mark.parametrize("mode", MODES)
def test_four_ranks_of_eight_sequences_sum_to_unit_loss_in_every_mode(mode):
    per_token = torch.ones(32, 5)
    mask = torch.ones(32, 5, dtype=torch.bool)
    num_tokens, num_seqs = count_loss_tokens(mask)
    full = aggregate_loss(per_token, mask, mode, num_tokens, num_seqs, normalizer=5)
    shares = [
        aggregate_loss(per_token[rank * 8:(rank + 1) * 8], mask[rank * 8:(rank + 1) * 8], mode,
                       num_tokens, num_seqs, normalizer=5)
        for rank in range(4)
    ]
    assert full.item() == 1.0
    assert_close(sum(shares), torch.tensor(1.0))
    assert_close(shares[0], torch.tensor(0.25))


@pytest.mark.parametrize("mode", MODES)
def test_loss_and_gradient_do_not_depend_on_the_micro_batch_split(mode):
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(16, 7, generator=generator)
    mask = torch.rand(16, 7, generator=generator) < 0.6
    mask[3] = False  # a zero-length completion
    num_tokens, num_seqs = count_loss_tokens(mask)

    def loss_and_grad(sizes):
        leaf = values.clone().requires_grad_(True)
        total = sum(
            aggregate_loss(piece, piece_mask, mode, num_tokens, num_seqs, normalizer=7)
            for piece, piece_mask in zip(leaf.split(sizes), mask.split(sizes))
        )
        total.backward()
        return total.detach(), leaf.grad

    full_loss, full_grad = loss_and_grad([16])
    for sizes in ([8, 8], [4, 4, 4, 4], [3, 5, 1, 7], [1] * 16):
        loss, grad = loss_and_grad(sizes)
        assert_close(loss, full_loss)
        assert_close(grad, full_grad)


def test_seq_mean_token_mean_weights_each_sequence_equally():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    # token mean would be 8/5 = 1.6; sequence means 1 and 4 -> 2.5
    assert aggregate_loss(per_token, mask, "seq_mean_token_mean", 5, 2).item() == 2.5


def test_seq_mean_token_sum_divides_by_a_constant_not_by_length():
    per_token = torch.tensor([[1.0, 1.0, 1.0, 1.0], [4.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, True], [True, False, False, False]])
    # (4 + 4) / (2 sequences * normalizer 8)
    assert aggregate_loss(per_token, mask, "seq_mean_token_sum", 5, 2, normalizer=8).item() == 0.5


def test_all_masked_step_gives_exact_zero_loss():
    per_token = torch.ones(2, 3, requires_grad=True)
    mask = torch.zeros(2, 3, dtype=torch.bool)
    for mode in MODES:
        loss = aggregate_loss(per_token, mask, mode, 0, 0, normalizer=3)
        assert loss.item() == 0.0


def test_a_local_token_count_passed_as_global_is_refused():
    with pytest.raises(ValueError, match="global_num_tokens is smaller"):
        aggregate_loss(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), "token_mean", 3, 1)


def test_seq_mean_token_sum_without_normalizer_is_refused():
    with pytest.raises(ValueError, match="normalizer"):
        aggregate_loss(torch.ones(1, 4), torch.ones(1, 4, dtype=torch.bool), "seq_mean_token_sum", 4, 1)
