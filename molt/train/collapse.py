"""Collapse of the policy onto few answers, seen per step rather than discovered afterwards.

Per step, over every row of the step batch, `row_metrics` gives (a group: the rows of a prompt_id)

    collapse/identical_groups_frac   groups of >= 2 rows with one and the same completion
    collapse/zero_variance_frac      groups whose rewards are all equal (no GRPO signal)

and the trainer adds ``entropy/mean`` (nats per trained token). `alarms` names the bounds a step
crosses; the train stage stops after ``stop_after`` in a row.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field


class CollapseConfig(BaseModel):
    """Bounds of the collapse alarms (train stage key ``collapse``)."""

    model_config = ConfigDict(extra="forbid")
    entropy_floor: float = Field(0.02, ge=0, description="alarm below this entropy/mean (nats)")
    identical_groups_max: float = Field(
        0.5, ge=0, le=1, description="alarm above this share of groups with identical completions")
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


def row_metrics(batch: pa.RecordBatch) -> dict[str, float]:
    """``reward/mean`` of a step batch and, with ``prompt_id``, the collapse fractions.

    Example: groups of rows [1, 2], [1, 2] (rewards 0, 0) and [1, 3], [1, 4] (rewards 1, 0),
    loss_mask [F, T] each -> reward/mean 0.25, identical_groups_frac 0.5, zero_variance_frac 0.5.
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
    identical = sum(len(g) > 1 and len({c for c, _ in g}) == 1 for g in groups.values())
    out["collapse/identical_groups_frac"] = identical / len(groups)
    if known:  # rewards to compare (SFT records have none)
        equal = sum(len({r for _, r in g}) == 1 for g in groups.values())
        out["collapse/zero_variance_frac"] = equal / len(groups)
    return out


def alarms(metrics: dict[str, float], config: CollapseConfig) -> list[str]:
    """The bounds a step's ``metrics`` cross (entropy only if it trained a token), as phrases.

    Example: {"entropy/mean": 0.01, "collapse/identical_groups_frac": 0.75, "tokens/count": 40}
    -> ["entropy 0.010 < 0.02", "identical groups 75% > 50%"].
    """
    out = []
    low = metrics.get("entropy/mean", 1.0) < config.entropy_floor
    if metrics.get("tokens/count", 0) > 0 and low:
        out.append(f"entropy {metrics['entropy/mean']:.3f} < {config.entropy_floor:g}")
    if (share := metrics.get("collapse/identical_groups_frac", 0.0)) > config.identical_groups_max:
        out.append(f"identical groups {share:.0%} > {config.identical_groups_max:.0%}")
    return out
