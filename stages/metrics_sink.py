"""MetricsSink: the end of a pipeline; counts rows and logs numeric column means.

For each batch it logs ``{column}_mean`` of every float/int scalar column it sees
(e.g. ``reward_mean``, ``score_mean``) and keeps running totals, so a run's summary
says how many rows arrived at the end of the DAG.
"""

from __future__ import annotations

from typing import ClassVar

import pyarrow as pa
import pyarrow.compute as pc

from molt.stage import Port, Transform


class MetricsSink(Transform):
    """Consumes every row; outputs nothing."""

    outputs: ClassVar[dict[str, Port]] = {}

    def setup(self) -> None:
        self.num_rows = 0

    def process(self, batch: pa.RecordBatch) -> None:
        self.num_rows += batch.num_rows
        means = {f"{f.name}_mean": pc.mean(batch.column(f.name)).as_py()
                 for f in batch.schema
                 if (pa.types.is_floating(f.type) or pa.types.is_integer(f.type)) and batch.num_rows}
        self.metrics.log({k: v for k, v in means.items() if v is not None})
        self.metrics.log({"rows_total": self.num_rows}, reduce={"rows_total": "sum"})
        return None

    def state_dict(self) -> dict:
        return {"num_rows": self.num_rows}

    def load_state_dict(self, state: dict) -> None:
        self.num_rows = int(state["num_rows"])
