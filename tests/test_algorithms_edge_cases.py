"""Empty and all-masked input for every public function of molt/algorithms/ (issue 4).

Each docstring states what its function does on empty ([0], [0, T], [B, 0]) or
all-masked input; these tests hold those claims: the shape is kept, values are
finite, exact zeros where claimed, and no NaN reaches a gradient.
"""

import math

import pytest
import torch

from molt.algorithms import (
    AdvantageInputs,
    CISPOLossConfig,
    DistillationConfig,
    DrGRPOConfig,
    GAEConfig,
    GeometricMISConfig,
    GRPOConfig,
    GSPOLossConfig,
    IcePopConfig,
    KLConfig,
    NoCorrectionConfig,
    PPOLossConfig,
    ReinforcePPBaselineConfig,
    ReinforcePPConfig,
    RLOOConfig,
    SeqMeanTokenMeanConfig,
    SeqMeanTokenSumConfig,
    SequenceMISConfig,
    TISConfig,
    TokenMeanConfig,
    aggregate_loss,
    apply_correction,
    cispo_loss,
    completion_loss_mask,
    count_loss_tokens,
    decoupled_ppo_loss,
    distillation_advantages,
    dr_grpo_advantages,
    entropy_bonus,
    fold_kl_into_rewards,
    gae_advantages,
    geometric_mis,
    group_metrics,
    group_stats,
    grpo_advantages,
    gspo_loss,
    icepop,
    index_rollouts,
    is_flat,
    kl_penalty,
    masked_log_ratio,
    merge_token_metrics,
    no_correction,
    outcome_token_rewards,
    overlong_penalty,
    policy_step_metrics,
    ppo_clip_loss,
    reinforce_pp_advantages,
    reinforce_pp_baseline_advantages,
    rloo_advantages,
    row_advantages,
    rows_to_tokens,
    select_informative_groups,
    sequence_mis,
    token_entropy,
    truncated_is,
)

EMPTY_SHAPES = [(0, 4), (3, 0), (0, 0)]
SHAPE_IDS = ["no_rows", "no_tokens", "nothing"]
# Off-mask garbage: an all-masked input must not let any of it through.
GARBAGE = torch.tensor([[math.nan, math.inf, -math.inf], [89.0, -89.0, math.nan]])
ALL_MASKED = torch.zeros(2, 3, dtype=torch.bool)

ESTIMATORS = [grpo_advantages, dr_grpo_advantages, rloo_advantages,
              reinforce_pp_advantages, reinforce_pp_baseline_advantages]
POLICY_LOSSES = {
    "ppo": lambda lp, old, adv, m: ppo_clip_loss(lp, old, adv, m, 0.2, 0.28, dual_clip=3.0),
    "gspo": gspo_loss,
    "cispo": lambda lp, old, adv, m: cispo_loss(lp, old, adv, m, clip_high=0.2, clip_low=0.2),
    "decoupled_ppo": lambda lp, old, adv, m: decoupled_ppo_loss(lp, old, -old, adv, m, behaviour_cap=2.0),
    "ppo_config": PPOLossConfig(dual_clip=3.0).compute,
    "gspo_config": GSPOLossConfig().compute,
    "cispo_config": CISPOLossConfig(clip_high=0.2).compute,
}
CORRECTIONS = {
    "none": no_correction,
    "tis": lambda t, r, m: truncated_is(t, r, m, cap=2.0),
    "icepop": lambda t, r, m: icepop(t, r, m, low=0.5, high=5.0),
    "seq_mis": lambda t, r, m: sequence_mis(t, r, m, cap=2.0),
    "geo_mis": lambda t, r, m: geometric_mis(t, r, m, low=0.5, high=1.5),
    "none_config": NoCorrectionConfig().compute,
    "tis_config": TISConfig().compute,
    "icepop_config": IcePopConfig().compute,
    "seq_mis_config": SequenceMISConfig(cap=2.0).compute,
    "geo_mis_config": GeometricMISConfig(low=0.5, high=1.5).compute,
}
AGGREGATIONS = [TokenMeanConfig(), SeqMeanTokenMeanConfig(), SeqMeanTokenSumConfig(normalizer=8.0)]
ADVANTAGE_CONFIGS = [GRPOConfig(), DrGRPOConfig(), RLOOConfig(), ReinforcePPConfig(),
                     ReinforcePPBaselineConfig(), GAEConfig(), DistillationConfig()]


def _zeros_with_zero_grad(out, leaf, shape):
    """out has `shape`, is exactly 0, and gives `leaf` an exactly-0 (not NaN) gradient."""
    assert out.shape == torch.Size(shape)
    assert torch.equal(out, torch.zeros(shape, dtype=out.dtype))
    if out.requires_grad:
        out.sum().backward()
        assert leaf.grad is None or torch.equal(leaf.grad, torch.zeros_like(leaf))


def _advantage_inputs(loss_mask, fill=0.0):
    rows, tokens = loss_mask.shape
    full = torch.full((rows, tokens), fill)
    return AdvantageInputs(
        prompt_ids=["p"] * rows, rollout_ids=[f"r{i}" for i in range(rows)],
        rewards=torch.arange(rows, dtype=torch.float32), loss_mask=loss_mask,
        rollout_logprobs=full, teacher_logprobs=-full, values=full,
    )


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda f: f.__name__)
def test_every_outcome_estimator_maps_no_rewards_to_no_advantages(estimator):
    out = estimator(torch.zeros(0), torch.zeros(0, dtype=torch.long))
    assert out.shape == (0,)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda f: f.__name__)
def test_every_outcome_estimator_gives_exact_zeros_and_no_nan_gradient_when_all_rewards_are_equal(estimator):
    rewards = torch.tensor([0.5, 0.5, 0.5, 0.5], requires_grad=True)
    _zeros_with_zero_grad(estimator(rewards, torch.tensor([0, 0, 0, 1])), rewards, (4,))


@pytest.mark.parametrize("estimator", [e for e in ESTIMATORS if e is not reinforce_pp_advantages],
                         ids=lambda f: f.__name__)
def test_every_group_estimator_gives_exact_zeros_and_no_nan_gradient_on_flat_groups(estimator):
    rewards = torch.tensor([0.35] * 7 + [2.0], requires_grad=True)  # a flat group and a group of one
    _zeros_with_zero_grad(estimator(rewards, torch.tensor([0] * 7 + [1])), rewards, (8,))


def test_group_statistics_of_no_values_are_empty_and_a_zero_std_has_zero_gradient():
    stats = group_stats(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0)
    assert all(t.shape == (0,) for t in (stats.count, stats.mean, stats.std, stats.flat))
    values = torch.tensor([1.0, 1.0], requires_grad=True)
    std = group_stats(values, torch.tensor([0, 0]), 1).std
    _zeros_with_zero_grad(std, values, (1,))


def test_an_empty_batch_indexes_to_no_rollouts_and_no_row_advantages():
    index = index_rollouts([], [], torch.zeros(0))
    assert index.num_groups == 0 and index.row_rollout.shape == (0,) and index.rollout_rewards.shape == (0,)
    assert row_advantages(grpo_advantages, [], [], torch.zeros(0)).shape == (0,)


@pytest.mark.parametrize("config", ADVANTAGE_CONFIGS, ids=lambda c: c.type)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=SHAPE_IDS)
def test_every_advantage_config_keeps_the_shape_of_an_empty_batch(config, shape):
    out = config.compute(_advantage_inputs(torch.zeros(shape, dtype=torch.bool)))
    assert torch.equal(out, torch.zeros(shape))


@pytest.mark.parametrize("config", ADVANTAGE_CONFIGS, ids=lambda c: c.type)
def test_every_advantage_config_gives_zeros_on_all_masked_rows_whatever_lies_off_mask(config):
    out = config.compute(_advantage_inputs(ALL_MASKED, fill=math.nan))
    assert torch.equal(out, torch.zeros(2, 3))


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=SHAPE_IDS)
def test_the_token_advantage_functions_keep_the_shape_of_an_empty_batch(shape):
    rows = shape[0]
    mask, zeros = torch.zeros(shape, dtype=torch.bool), torch.zeros(shape)
    assert torch.equal(outcome_token_rewards(torch.ones(rows), mask), zeros)
    advantages, returns = gae_advantages(zeros, zeros, mask, gamma=0.9, lam=0.5)
    assert torch.equal(advantages, zeros) and torch.equal(returns, zeros)
    assert torch.equal(distillation_advantages(zeros, zeros, mask), zeros)
    assert torch.equal(rows_to_tokens(torch.ones(rows), mask), zeros)


def test_the_token_advantage_functions_give_zeros_on_all_masked_rows_holding_nan_and_inf():
    zeros = torch.zeros(2, 3)
    assert torch.equal(outcome_token_rewards(torch.tensor([math.nan, 1.0]), ALL_MASKED), zeros)
    advantages, returns = gae_advantages(GARBAGE, GARBAGE, ALL_MASKED, gamma=0.9, lam=0.5)
    assert torch.equal(advantages, zeros) and torch.equal(returns, zeros)
    assert torch.equal(distillation_advantages(GARBAGE, -GARBAGE, ALL_MASKED), zeros)
    assert torch.equal(rows_to_tokens(torch.tensor([math.nan, 1.0]), ALL_MASKED), zeros)


@pytest.mark.parametrize("name", POLICY_LOSSES)
def test_every_policy_loss_is_zero_with_zero_gradient_on_all_masked_input_holding_nan_and_inf(name):
    logprobs = GARBAGE.clone().requires_grad_(True)
    out = POLICY_LOSSES[name](logprobs, -GARBAGE, GARBAGE, ALL_MASKED)
    assert torch.equal(out.ratio, torch.ones(2, 3))
    assert not (out.clipped_low.any() or out.clipped_high.any() or out.dual_clipped.any())
    _zeros_with_zero_grad(out.per_token_loss, logprobs, (2, 3))


@pytest.mark.parametrize("name", POLICY_LOSSES)
@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=SHAPE_IDS)
def test_every_policy_loss_keeps_the_shape_of_an_empty_batch(name, shape):
    logprobs = torch.zeros(shape, requires_grad=True)
    out = POLICY_LOSSES[name](logprobs, torch.zeros(shape), torch.ones(shape), torch.zeros(shape, dtype=torch.bool))
    assert out.ratio.shape == out.clipped_low.shape == out.dual_clipped.shape == shape
    _zeros_with_zero_grad(out.per_token_loss, logprobs, shape)


@pytest.mark.parametrize("shape", [*EMPTY_SHAPES, (2, 3)], ids=[*SHAPE_IDS, "all_masked"])
def test_the_masked_log_ratio_of_an_empty_or_all_masked_batch_is_zero(shape):
    logprobs = torch.full(shape, math.nan, requires_grad=True)
    out = masked_log_ratio(logprobs, torch.full(shape, math.inf), torch.zeros(shape, dtype=torch.bool))
    _zeros_with_zero_grad(out, logprobs, shape)


@pytest.mark.parametrize("name", CORRECTIONS)
@pytest.mark.parametrize("shape", [*EMPTY_SHAPES, (2, 3)], ids=[*SHAPE_IDS, "all_masked"])
def test_every_correction_keeps_nothing_of_an_empty_or_all_masked_batch(name, shape):
    garbage = GARBAGE if shape == (2, 3) else torch.zeros(shape)
    correction = CORRECTIONS[name](garbage, -garbage, torch.zeros(shape, dtype=torch.bool))
    assert torch.equal(correction.weight, torch.zeros(shape))
    assert not correction.keep.any() and correction.keep.shape == shape
    loss = garbage.clone().requires_grad_(True)
    _zeros_with_zero_grad(apply_correction(loss, correction), loss, shape)


@pytest.mark.parametrize("estimator", ["k1", "k2", "k3"])
@pytest.mark.parametrize("shape", [*EMPTY_SHAPES, (2, 3)], ids=[*SHAPE_IDS, "all_masked"])
def test_every_kl_estimator_is_zero_with_zero_gradient_on_an_empty_or_all_masked_batch(estimator, shape):
    garbage = GARBAGE if shape == (2, 3) else torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    for penalty in (lambda lp: kl_penalty(lp, -garbage, mask, estimator),
                    lambda lp: KLConfig(estimator=estimator, coef=0.1, apply_to="loss").per_token(lp, -garbage, mask)):
        logprobs = garbage.clone().requires_grad_(True)
        _zeros_with_zero_grad(penalty(logprobs), logprobs, shape)


def test_folding_kl_into_no_rewards_or_no_tokens_keeps_the_rewards():
    assert fold_kl_into_rewards(torch.zeros(0), torch.zeros(0, 4), coef=0.1).shape == (0,)
    rewards = torch.tensor([1.0, -2.0, 0.5])
    assert torch.equal(fold_kl_into_rewards(rewards, torch.zeros(3, 0), coef=0.1), rewards)


@pytest.mark.parametrize("config", AGGREGATIONS, ids=lambda c: c.type)
@pytest.mark.parametrize("shape", [*EMPTY_SHAPES, (2, 3)], ids=[*SHAPE_IDS, "all_masked"])
def test_every_aggregation_mode_returns_exact_zero_with_zero_gradient_without_valid_tokens(config, shape):
    mask = torch.zeros(shape, dtype=torch.bool)
    assert count_loss_tokens(mask) == (0, 0)
    for global_tokens, global_seqs in ((0, 0), (5, 2)):  # empty step, or an empty micro-batch of a step
        loss = (GARBAGE if shape == (2, 3) else torch.zeros(shape)).clone().requires_grad_(True)
        _zeros_with_zero_grad(config.reduce(loss, mask, global_tokens, global_seqs), loss, ())
        loss.grad = None
        out = aggregate_loss(loss, mask, config.type, global_tokens, global_seqs, normalizer=8.0)
        _zeros_with_zero_grad(out, loss, ())


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=SHAPE_IDS)
def test_entropy_and_its_bonus_keep_the_shape_of_an_empty_batch(shape):
    assert torch.equal(token_entropy(torch.zeros(*shape, 5)), torch.zeros(shape))
    entropy = torch.zeros(shape, requires_grad=True)
    _zeros_with_zero_grad(entropy_bonus(entropy, torch.zeros(shape, dtype=torch.bool), 0.01), entropy, shape)


def test_a_position_whose_logits_are_all_minus_inf_has_zero_entropy_and_zero_gradient():
    logits = torch.tensor([[[-math.inf, -math.inf, -math.inf], [0.0, -math.inf, 1.0]]], requires_grad=True)
    entropy = token_entropy(logits)
    assert entropy[0, 0].item() == 0.0 and math.isfinite(entropy[0, 1].item())
    entropy.sum().backward()
    assert torch.equal(logits.grad[0, 0], torch.zeros(3)) and logits.grad.isfinite().all()
    assert torch.equal(token_entropy(torch.zeros(2, 3, 0)), torch.zeros(2, 3))


def test_the_entropy_bonus_of_all_masked_tokens_is_zero_with_zero_gradient():
    entropy = GARBAGE.clone().requires_grad_(True)
    _zeros_with_zero_grad(entropy_bonus(entropy, ALL_MASKED, 0.01), entropy, (2, 3))


def test_dapo_extras_accept_no_groups_no_rewards_and_no_rows():
    assert is_flat([])
    selection = select_informative_groups([], num_groups_per_step=3)
    assert (selection.keep, selection.surplus, selection.dropped, selection.num_more_needed) == ([], [], [], 3)
    assert select_informative_groups([[], [1.0, 0.0]], 1).dropped == [0]
    assert overlong_penalty(torch.zeros(0, dtype=torch.long), 20, 4).shape == (0,)
    assert torch.equal(overlong_penalty(torch.tensor([0]), 20, 4), torch.zeros(1))


@pytest.mark.parametrize("shape", EMPTY_SHAPES, ids=SHAPE_IDS)
def test_the_completion_mask_of_an_empty_batch_is_empty_and_false(shape):
    ids = torch.zeros(shape, dtype=torch.long)
    assert torch.equal(completion_loss_mask(ids, eos_id=2), torch.zeros(shape, dtype=torch.bool))
    cut = completion_loss_mask(ids, eos_id=2, num_generated=torch.zeros(shape[0], dtype=torch.long))
    assert torch.equal(cut, torch.zeros(shape, dtype=torch.bool))


@pytest.mark.parametrize("shape", [*EMPTY_SHAPES, (2, 3)], ids=[*SHAPE_IDS, "all_masked"])
def test_every_step_metric_of_an_empty_or_all_masked_batch_is_zero(shape):
    garbage = GARBAGE if shape == (2, 3) else torch.zeros(shape)
    mask = torch.zeros(shape, dtype=torch.bool)
    loss = ppo_clip_loss(garbage, -garbage, garbage, mask, dual_clip=3.0)
    metrics = policy_step_metrics(mask, garbage, loss, truncated_is(garbage, -garbage, mask, 2.0),
                                  garbage, -garbage, garbage, garbage)
    assert len(metrics) == 17 and all(value == 0.0 for value in metrics.values())
    merged = merge_token_metrics([metrics, metrics])
    assert merged == metrics


def test_merging_no_metrics_gives_an_empty_dict():
    assert merge_token_metrics([]) == {}


def test_every_group_metric_of_an_empty_batch_is_zero():
    metrics = group_metrics([], [], torch.zeros(0), [], row_advantages=torch.zeros(0))
    assert len(metrics) == 9 and all(value == 0.0 for value in metrics.values())
