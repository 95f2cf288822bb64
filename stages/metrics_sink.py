"""MetricsSink: the end of a pipeline; counts rows and logs numeric column means.

After each batch it logs ``rows_total`` and ``{column}_mean`` of every numeric scalar column
seen, over every row so far (nulls skipped).
Example: batches with score [1, 0] then [1, 1] -> score_mean 0.5, then 0.75.
"""

from __future__ import annotations

import pyarrow as pa
import pyarrow.compute as pc

from molt.runtime.stage import Transform


class MetricsSink(Transform):
    """Consumes every row; outputs nothing."""

    outputs = {}

    def setup(self) -> None:
        self.num_rows = 0
        self.sums: dict[str, list[float]] = {}  # column -> [sum, count]

    def process(self, batch: pa.RecordBatch) -> None:
        self.num_rows += batch.num_rows
        for f in batch.schema:
            if pa.types.is_floating(f.type) or pa.types.is_integer(f.type):
                col = batch.column(f.name)
                acc = self.sums.setdefault(f.name, [0.0, 0.0])
                acc[0] += pc.sum(col).as_py() or 0.0
                acc[1] += len(col) - col.null_count
        self.metrics.log({f"{k}_mean": s / n for k, (s, n) in self.sums.items() if n})
        self.metrics.log({"rows_total": self.num_rows}, reduce={"rows_total": "sum"})

    def state_dict(self) -> dict:
        return {"num_rows": self.num_rows, "sums": self.sums}

    def load_state_dict(self, state: dict) -> None:
        self.num_rows, self.sums = int(state["num_rows"]), state["sums"]
