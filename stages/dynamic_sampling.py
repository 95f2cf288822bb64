"""DynamicSampling: DAPO's filter that drops groups whose rewards are all equal.

Such a group has zero advantage under group-relative estimators, so no gradient (DAPO, arXiv
2503.14476, §3.2); the pack stage takes the next group instead. Drops are counted. Under a
staleness bound the rollout must hear of each drop or it waits for a version that never comes:
``notify_drops: true`` sends the running count of dropped groups on ``drops`` after every batch
that dropped one (a broadcast feedback edge to the rollout's ``drops``), and again when a
resumed run starts.
Example: groups with rewards [1, 0, 1, 1] and [0, 0, 0, 0] -> the first is kept; the notice says
``{filter_replica: 0, num_groups_dropped: 1}``.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import pyarrow as pa
from pydantic import Field

from molt.algorithms.dapo import is_flat
from molt.schema import DROP_NOTICE_SCHEMA, batch_from_rows
from molt.runtime.stage import Port, StageConfig, Transform


class DynamicSampling(Transform):
    """Keeps the rows of groups whose rewards differ; counts what it drops."""

    class Config(StageConfig):
        notify_drops: bool = Field(False, description="send the count of dropped groups on 'drops'")

    config: Config
    inputs = {"in": Port(reads=("prompt_id", "rollout_id", "reward"))}
    drops_groups = True

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        assert isinstance(config, cls.Config)
        drops = {"drops": Port(schema=DROP_NOTICE_SCHEMA)} if config.notify_drops else {}
        return dict(cls.inputs), {"out": Port(passes="in"), **drops}

    def setup(self) -> None:
        self.num_groups_dropped = self.num_notified = 0

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        prompts = batch.column("prompt_id").to_pylist()
        per_group: dict[str, dict[str, float]] = defaultdict(dict)
        columns = (batch.column(c).to_pylist() for c in ("rollout_id", "reward"))
        for p, r, x in zip(prompts, *columns):
            per_group[p][r] = x  # segments of one rollout share one reward: count it once
        flat = {p for p, group in per_group.items() if is_flat(list(group.values()))}
        keep = [p not in flat for p in prompts]
        self.num_groups_dropped += len(flat)
        self.metrics.count("groups_dropped", len(flat))
        self.metrics.count("groups_kept", len(per_group) - len(flat))
        self.metrics.count("rows_dropped", keep.count(False))
        return batch.filter(pa.array(keep)) if any(keep) else None

    async def run(self) -> None:
        await self._notify()  # a resumed run's count, which the rollout may not have
        await super().run()

    async def emit(self, result: pa.RecordBatch | None) -> None:
        await super().emit(result)
        if self.num_groups_dropped > self.num_notified:
            await self._notify()

    async def _notify(self) -> None:
        if self.config.notify_drops and self.num_groups_dropped:
            notice = {"filter_replica": self.ctx.replica,
                      "num_groups_dropped": self.num_groups_dropped}
            await self.send("drops", batch_from_rows([notice], DROP_NOTICE_SCHEMA))
            self.num_notified = self.num_groups_dropped

    def state_dict(self) -> dict[str, Any]:
        return {"num_groups_dropped": self.num_groups_dropped}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_groups_dropped = self.num_notified = int(state["num_groups_dropped"])
