"""Collapse seen per step (molt.train.collapse): identical groups, equal rewards, the trainer's
token entropy, the alarms of the step line and of the runner's progress line, and the stop."""

import json
import logging
import math

import pytest
import torch

from molt.schema import batch_from_rows, make_schema, resolve_fields
from molt.train.collapse import CollapseConfig, CollapseWatch, alarms, row_metrics
from molt.train.logprobs import target_logprobs, target_logprobs_entropy

SCHEMA = make_schema(resolve_fields(("sample_id", "prompt_id", "rollout_id", "token_ids", "loss_mask", "reward"),
                                    "test"), "trajectory")


def group(pid, completions, rewards, prompt=(1, 2, 3)):
    return [{"sample_id": f"{pid}/{k}", "prompt_id": pid, "rollout_id": f"{pid}/{k}",
             "token_ids": [*prompt, *c], "loss_mask": [False] * len(prompt) + [True] * len(c), "reward": r}
            for k, (c, r) in enumerate(zip(completions, rewards))]


def test_a_batch_of_identical_completions_is_reported_as_such():
    same = group("a", [[57, 44, 61]] * 8, [0.0] * 8)
    mixed = group("b", [[30, 53, 83]] * 7 + [[30, 53, 63]], [1.0] * 7 + [0.0])
    equal_rewards = group("c", [[5], [6], [7], [8]], [1.0] * 4)
    one = group("d", [[9]], [1.0])  # a group of one row is not "identical"
    metrics = row_metrics(batch_from_rows(same + mixed + equal_rewards + one, SCHEMA))
    assert metrics["collapse/identical_groups_frac"] == metrics["collapse/identical_wrong_frac"] == 0.25
    assert metrics["collapse/zero_variance_frac"] == 0.75  # a, c and d: no GRPO signal
    assert metrics["reward/mean"] == pytest.approx((7 + 4 + 1) / 21)
    assert row_metrics(batch_from_rows(same, SCHEMA))["collapse/identical_groups_frac"] == 1.0
    # the same completion after different prompts (multi-turn segments) still counts by generated tokens only
    assert row_metrics(batch_from_rows(group("e", [[4]] * 2, [0, 1], prompt=(1,)) + group("e", [[4]], [0]), SCHEMA)
                       )["collapse/identical_groups_frac"] == 1.0


def converged_and_collapsed():
    """Step batches of 8 groups of 8: 5 groups of one right answer and 1 of one wrong answer (a converged
    policy, as the quickstart's 62% identical groups at 78.8%), and 5 groups of one wrong answer."""
    right = [group(f"r{k}", [[30 + k, 2]] * 8, [1.0] * 8) for k in range(5)]
    varied = [group(f"v{k}", [[k, j] for j in range(8)], [1.0] * 4 + [0.0] * 4) for k in range(2)]
    wrong = [group(f"w{k}", [[40 + k, 3]] * 8, [0.0] * 8) for k in range(5)]
    converged = [row for g in right + varied + wrong[:1] for row in g]
    collapsed = [row for g in wrong + varied + [group("v2", [[9, j] for j in range(8)], [0.0] * 8)] for row in g]
    return row_metrics(batch_from_rows(converged, SCHEMA)), row_metrics(batch_from_rows(collapsed, SCHEMA))


def test_a_converged_batch_raises_no_alarm_and_identical_wrong_completions_do():
    converged, collapsed = converged_and_collapsed()
    assert alarms(converged, CollapseConfig()) == [], "eight right answers out of eight is convergence"
    assert alarms(collapsed, CollapseConfig()) == ["identical wrong groups 62% > 40%"]
    assert converged["collapse/identical_groups_frac"] == 0.75 and converged["collapse/identical_wrong_frac"] == 0.125
    assert collapsed["collapse/identical_groups_frac"] == collapsed["collapse/identical_wrong_frac"] == 0.625
    # shaped rewards: a right answer keeps a reward above 0 under the overlong penalty, a wrong one at most 0
    shaped = row_metrics(batch_from_rows(group("a", [[1]] * 2, [0.4] * 2) + group("b", [[2]] * 2, [-0.5] * 2), SCHEMA))
    assert shaped["collapse/identical_wrong_frac"] == 0.5
    assert row_metrics(batch_from_rows(group("a", [[1]] * 2, [0.4] * 2), SCHEMA), wrong_reward_max=0.5
                       )["collapse/identical_wrong_frac"] == 1.0


def test_the_alarm_names_the_crossed_bound_and_stops_after_steps_in_a_row():
    config = CollapseConfig(identical_wrong_max=0.5, stop_after=2)
    healthy = {"entropy/mean": 0.01, "collapse/identical_groups_frac": 1.0, "collapse/identical_wrong_frac": 0.1}
    collapsed = {"entropy/mean": 0.01, "collapse/identical_groups_frac": 0.75, "collapse/identical_wrong_frac": 0.75}
    assert alarms(healthy, config) == [] and alarms(collapsed, config) == ["identical wrong groups 75% > 50%"]
    watch = CollapseWatch(config, "stages.train.config")
    assert watch(collapsed) and watch(healthy) == [] and watch(collapsed), "a healthy step resets the count"
    with pytest.raises(RuntimeError, match=r"the policy collapsed: identical wrong groups 75% > 50% "
                                           r"for 2 steps in a row \(stages.train.config.collapse.stop_after is 2\)"):
        watch(collapsed)
    assert all(CollapseWatch(CollapseConfig(), "x")(collapsed) for _ in range(5)), "warn only by default"


def test_the_progress_line_warns_of_collapse_only_for_identical_wrong_groups(tmp_path):
    from molt.runtime.pipeline import Pipeline
    from molt.runtime.progress import Progress
    from tests.conftest import SINK, SOURCE

    spec = {"name": "t", "stages": {"train": {"class": SOURCE}, "sink": {"class": SINK}},
            "edges": [{"from": "train", "to": "sink"}]}
    lines = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append((record.levelno, record.getMessage()))
    logging.getLogger("molt.runner").addHandler(handler)
    try:
        for step, metrics in enumerate(converged_and_collapsed()):  # as the train stage logs them
            values = {**metrics, "collapse/alarms": len(CollapseWatch(CollapseConfig(), "x")(metrics))}
            (tmp_path / "metrics").mkdir(parents=True, exist_ok=True)
            with open(tmp_path / "metrics" / "train.0.jsonl", "a") as f:
                f.write(json.dumps({"stage": "train", "replica": 0, "step": step, "time": 0.0,
                                    "values": {f"train/{k}": v for k, v in values.items()}}) + "\n")
            with Progress(Pipeline.from_spec(spec), tmp_path, live=False, log_every_s=0) as progress:
                progress.update(10.0)
    finally:
        logging.getLogger("molt.runner").removeHandler(handler)
    (healthy_level, healthy), (collapsed_level, collapsed) = lines
    assert healthy_level == logging.INFO and "COLLAPSE" not in healthy
    assert collapsed_level == logging.WARNING and "COLLAPSE train: collapse/identical_wrong_frac 0.625, " \
        "collapse/identical_groups_frac 0.625, collapse/zero_variance_frac 0.75" in collapsed


@pytest.mark.parametrize("chunk_tokens", [3, 100])
def test_the_trainers_entropy_is_that_of_the_full_softmax_and_leaves_logprobs_and_gradients_alone(chunk_tokens):
    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(7, 5, generator=gen, requires_grad=True)
    weight = (torch.randn(11, 5, generator=gen) * 3).requires_grad_()
    targets = torch.randint(0, 11, (7,), generator=gen)
    logp, entropy = target_logprobs_entropy(hidden, weight, targets, 0.7, chunk_tokens)
    logp.sum().backward()
    grads = hidden.grad.clone()
    hidden.grad = None
    plain = target_logprobs(hidden, weight, targets, 0.7, chunk_tokens)
    plain.sum().backward()
    torch.testing.assert_close(logp, plain, rtol=0, atol=0)
    torch.testing.assert_close(grads, hidden.grad, rtol=0, atol=0)
    p = torch.softmax(hidden @ weight.t() / 0.7, -1)
    torch.testing.assert_close(entropy, -(p * p.log()).sum(-1))
    assert not entropy.requires_grad
    # the docstring's example; a one-hot distribution (far apart logits) has entropy 0, not NaN
    _, h = target_logprobs_entropy(torch.tensor([[1.0, 0.0]]), torch.tensor([[1.0, 0.0], [0.0, 0.0]]),
                                   torch.tensor([0]), 1.0)
    assert h.item() == pytest.approx(math.log(math.e + 1) - math.e / (math.e + 1))
    _, h = target_logprobs_entropy(torch.tensor([[1.0]]), torch.tensor([[1e4], [0.0]]), torch.tensor([0]), 1.0)
    assert h.item() == 0.0


def test_records_without_rewards_have_no_zero_variance_share():
    schema = make_schema(resolve_fields(("sample_id", "prompt_id", "rollout_id", "token_ids", "loss_mask"), "test"),
                         "trajectory")
    rows = [{k: v for k, v in r.items() if k != "reward"} for r in group("a", [[1], [2]], [None, None])]
    assert row_metrics(batch_from_rows(rows, schema)) == {"reward/mean": 0.0, "collapse/identical_groups_frac": 0.0}
