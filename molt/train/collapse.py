"""Collapse of the policy onto wrong answers, seen per step rather than discovered afterwards.

Per step, over every row of the step batch, `row_metrics` gives (a group: the rows of a prompt_id)

    collapse/identical_groups_frac   groups of >= 2 rows with one and the same completion
    collapse/identical_wrong_frac    those whose reward is <= ``wrong_reward_max``
    collapse/zero_variance_frac      groups whose rewards are all equal (no GRPO signal)

and the trainer adds ``entropy/mean`` (nats per trained token). A converged policy (one right
answer eight times) has identical groups and a low entropy too, so `alarms` bounds only the
identical wrong groups; the train stage stops after ``stop_after`` alarmed steps in a row.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field


class CollapseConfig(BaseModel):
    """Bounds of the collapse alarm (train stage key ``collapse``)."""

    model_config = ConfigDict(extra="forbid")
    identical_wrong_max: float = Field(
        0.4, ge=0, le=1, description="alarm above this identical_wrong_frac")
    wrong_reward_max: float = Field(
        0.0, description="a reward at most this is wrong (graders: 1 right, 0 wrong)")
    stop_after: int | None = Field(
        None, ge=1, description="stop the run after this many alarmed steps in a row; None = warn")


class CollapseWatch:
    """``watch(metrics) -> alarms`` of each step in turn.

    Raises:
        RuntimeError: at ``stop_after`` alarmed steps in a row.
    """

    def __init__(self, config: CollapseConfig, where: str) -> None:
        self.config, self.where, self.in_a_row = config, where, 0

    def __call__(self, metrics: dict[str, float]) -> list[str]:
        crossed = alarms(metrics, self.config)
        self.in_a_row = self.in_a_row + 1 if crossed else 0
        if self.config.stop_after is not None and self.in_a_row >= self.config.stop_after:
            raise RuntimeError(f"the policy collapsed: {', '.join(crossed)} for {self.in_a_row} "
                               f"steps in a row ({self.where}.collapse.stop_after is "
                               f"{self.config.stop_after}); hint: the run's checkpoints hold "
                               "earlier versions (molt run --resume), and a lower lr or a KL "
                               "term keeps the policy near its start")
        return crossed


def row_metrics(batch: pa.RecordBatch, wrong_reward_max: float = 0.0) -> dict[str, float]:
    """``reward/mean`` of a step batch and, with ``prompt_id``, the collapse fractions.

    Example: groups of rows [1, 2], [1, 2] (rewards 0, 0) and [1, 3], [1, 4] (rewards 1, 0),
    loss_mask [F, T] each -> reward/mean 0.25, identical_groups_frac 0.5, identical_wrong_frac
    0.5 (0 with rewards 1, 1 in the first group), zero_variance_frac 0.5.
    """
    names = batch.schema.names
    rewards = batch.column("reward").to_pylist() if "reward" in names else [None] * batch.num_rows
    known = [r for r in rewards if r is not None]
    out = {"reward/mean": sum(known) / max(len(known), 1)}
    if "prompt_id" not in names or batch.num_rows == 0:
        return out
    groups: dict[str, list[tuple[tuple[int, ...], float | None]]] = defaultdict(list)
    columns = (batch.column(c).to_pylist() for c in ("prompt_id", "token_ids", "loss_mask"))
    for pid, ids, mask, reward in zip(*columns, rewards):
        groups[pid].append((tuple(t for t, m in zip(ids, mask) if m), reward))
    identical = [g for g in groups.values() if len(g) > 1 and len({c for c, _ in g}) == 1]
    out["collapse/identical_groups_frac"] = len(identical) / len(groups)
    if known:  # rewards to compare (SFT records have none)
        wrong = sum(all(r is not None and r <= wrong_reward_max for _, r in g) for g in identical)
        out["collapse/identical_wrong_frac"] = wrong / len(groups)
        equal = sum(len({r for _, r in g}) == 1 for g in groups.values())
        out["collapse/zero_variance_frac"] = equal / len(groups)
    return out


def alarms(metrics: dict[str, float], config: CollapseConfig) -> list[str]:
    """The bounds a step's ``metrics`` cross, as phrases.

    Example: {"collapse/identical_groups_frac": 0.75, "collapse/identical_wrong_frac": 0.5}
    -> ["identical wrong groups 50% > 40%"].
    """
    share, bound = metrics.get("collapse/identical_wrong_frac", 0.0), config.identical_wrong_max
    return [f"identical wrong groups {share:.0%} > {bound:.0%}"] if share > bound else []
