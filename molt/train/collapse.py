"""Collapse of the policy onto few answers, seen per step rather than discovered afterwards.

Seen in the quickstart (a bf16 trainer against an fp32 engine): by step 16 most groups held
eight identical completions with a wrong sum ("57 + 44 = 61."), their rewards all equal, so
GRPO gave them no gradient, while held-out accuracy fell from 58.8% to 25.0%. Per step, over
every row of the step batch (inert rows included), `row_metrics` gives:

    collapse/identical_groups_frac   groups of >= 2 rows whose completions (the loss_mask
                                     tokens) are one and the same token sequence
    collapse/zero_variance_frac      groups whose rewards are all equal (no GRPO signal)

and the trainer adds ``entropy/mean``: the mean entropy (nats per token) of the sampling
distribution softmax(z / temperature) at the tokens it trains, from its own logits
(molt.train.logprobs; absent from a step whose rows were all inert; SFT steps raise no alarm).
`CollapseConfig` sets the bounds; `alarms` names the ones crossed,
which the train stage writes into its step line and as ``collapse/alarms`` (the progress
view shows them), and after ``stop_after`` alarmed steps in a row it stops the run.
A group is the rows of one ``prompt_id``.
"""

from __future__ import annotations

from collections import defaultdict

import pyarrow as pa
from pydantic import BaseModel, ConfigDict, Field


class CollapseConfig(BaseModel):
    """Bounds of the collapse alarms (train stage key ``collapse``)."""

    model_config = ConfigDict(extra="forbid")
    entropy_floor: float = Field(0.02, ge=0, description="alarm when entropy/mean (nats per trained token) is below")
    identical_groups_max: float = Field(0.5, ge=0, le=1, description="alarm when a larger share of the step's "
                                        "groups hold identical completions")
    stop_after: int | None = Field(None, ge=1, description="stop the run after this many alarmed steps in a row "
                                   "(an error naming the bounds); None = warn only")


class CollapseWatch:
    """``watch(metrics) -> alarms`` of each step in turn; counts alarmed steps in a row.

    Raises (on the call that makes ``stop_after`` in a row):
        RuntimeError: naming the bounds crossed and the key that set the limit.
    """

    def __init__(self, config: CollapseConfig, where: str) -> None:
        self.config, self.where, self.in_a_row = config, where, 0

    def __call__(self, metrics: dict[str, float]) -> list[str]:
        crossed = alarms(metrics, self.config)
        self.in_a_row = self.in_a_row + 1 if crossed else 0
        if self.config.stop_after is not None and self.in_a_row >= self.config.stop_after:
            raise RuntimeError(f"the policy collapsed: {', '.join(crossed)} for {self.in_a_row} steps in a row "
                               f"({self.where}.collapse.stop_after is {self.config.stop_after}); hint: the run's "
                               "checkpoints hold earlier versions (molt run --resume), and a lower lr or a KL term "
                               "keeps the policy near its start")
        return crossed


def row_metrics(batch: pa.RecordBatch) -> dict[str, float]:
    """Statistics of a step batch's rows: ``reward/mean`` (0.0 without rewards) and, with a
    ``prompt_id`` column, ``collapse/identical_groups_frac`` and (with rewards) ``collapse/zero_variance_frac``.

    Example: two groups, one of rows [1, 2] and [1, 2] (completion [2], rewards 0 and 0), one of
    rows [1, 3] and [1, 4] (rewards 1 and 0), loss_mask [False, True] each
    -> {"reward/mean": 0.25, "collapse/identical_groups_frac": 0.5, "collapse/zero_variance_frac": 0.5}.
    """
    rewards = batch.column("reward").to_pylist() if "reward" in batch.schema.names else [None] * batch.num_rows
    known = [r for r in rewards if r is not None]
    out = {"reward/mean": sum(known) / max(len(known), 1)}
    if "prompt_id" not in batch.schema.names or batch.num_rows == 0:
        return out
    groups: dict[str, list[tuple[tuple[int, ...], float | None]]] = defaultdict(list)
    for pid, ids, mask, reward in zip(batch.column("prompt_id").to_pylist(), batch.column("token_ids").to_pylist(),
                                      batch.column("loss_mask").to_pylist(), rewards):
        groups[pid].append((tuple(t for t, m in zip(ids, mask) if m), reward))
    identical = sum(len(g) > 1 and len({c for c, _ in g}) == 1 for g in groups.values())
    out["collapse/identical_groups_frac"] = identical / len(groups)
    if known:  # rewards to compare (SFT records have none)
        out["collapse/zero_variance_frac"] = sum(len({r for _, r in g}) == 1 for g in groups.values()) / len(groups)
    return out


def alarms(metrics: dict[str, float], config: CollapseConfig) -> list[str]:
    """The collapse bounds ``metrics`` (a step's) cross, as short phrases; [] when none.

    Example: {"entropy/mean": 0.01, "collapse/identical_groups_frac": 0.75, "tokens/count": 40}
    -> ["entropy 0.010 < 0.02", "identical groups 75% > 50%"]. A step that trained no token
    (all rows inert) is judged by its identical groups only.
    """
    out = []
    if metrics.get("tokens/count", 0) > 0 and metrics.get("entropy/mean", 1.0) < config.entropy_floor:
        out.append(f"entropy {metrics['entropy/mean']:.3f} < {config.entropy_floor:g}")
    if (share := metrics.get("collapse/identical_groups_frac", 0.0)) > config.identical_groups_max:
        out.append(f"identical groups {share:.0%} > {config.identical_groups_max:.0%}")
    return out
