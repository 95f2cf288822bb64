"""DynamicSampling: DAPO's filter that drops groups whose rewards are all equal.

A group whose rollouts all got the same reward has exactly zero advantage under
group-relative estimators and so no policy gradient (DAPO, arXiv 2503.14476, §3.2);
dropping it keeps each optimizer step full of informative groups: the pack stage
downstream takes a fixed number of groups per step, so it simply admits more.
Drops are never silent: ``groups_dropped`` and ``rows_dropped`` are counted, and
recording this stage's input edge keeps every row for inspection. A rollout upstream
must admit without a staleness bound (``max_staleness: null``): a bounded one admits by
the groups it released, counting a dropped group as trained, and would wait for a
version that never comes; the pipeline refuses that pairing when it loads.
Example: groups with rewards [1, 0, 1, 1] and [0, 0, 0, 0] -> the first is kept.
"""

from __future__ import annotations

from collections import defaultdict
from typing import ClassVar

import pyarrow as pa

from molt.algorithms.dapo import is_flat
from molt.stage import Port, Transform


class DynamicSampling(Transform):
    """Keeps the rows of groups whose rewards differ; counts what it drops."""

    inputs: ClassVar[dict[str, Port]] = {"in": Port(reads=("prompt_id", "rollout_id", "reward"))}
    drops_groups = True  # so a bounded-staleness rollout upstream is refused at load (molt.pipeline)

    def process(self, batch: pa.RecordBatch) -> pa.RecordBatch | None:
        prompts = batch.column("prompt_id").to_pylist()
        per_group: dict[str, dict[str, float]] = defaultdict(dict)
        for p, r, x in zip(prompts, batch.column("rollout_id").to_pylist(), batch.column("reward").to_pylist()):
            per_group[p][r] = x  # segments of one rollout share one reward: count it once
        flat = {p for p, rewards in per_group.items() if is_flat(list(rewards.values()))}
        keep = [p not in flat for p in prompts]
        self.metrics.count("groups_dropped", len(flat))
        self.metrics.count("groups_kept", len(per_group) - len(flat))
        self.metrics.count("rows_dropped", keep.count(False))
        return batch.filter(pa.array(keep)) if any(keep) else None
