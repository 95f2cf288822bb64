"""Pack: gathers exactly ``groups_per_step`` prompt groups per optimizer step and
places their rows on data-parallel ranks and micro-batches (DESIGN §8).

Input: trajectory batches holding whole groups (from an advantage stage; a batch may
hold several groups, a group never spans batches). Output: ONE record batch per
step, rows ordered by (dp_rank, micro_batch), every input column passed through plus:

    step              int32  optimizer step this row trains in (0, 1, ...)
    dp_rank           int32  data-parallel rank that trains the row
    micro_batch       int32  micro-batch index on that rank; every rank has the same
                             number M = max(micro_batch) + 1 of micro-batches (a rank
                             may have an empty one: the trainer runs a zero-loss dummy)
    step_loss_tokens  int64  the step's loss_mask tokens over all ranks (loss denominator)
    step_loss_seqs    int64  the step's rows with >= 1 loss_mask token (seq-mean denominator)

Rows whose loss_mask is all false are trained (they count in the token budget) and
add 0 to both denominators, as molt.algorithms.aggregation counts them. Sequences
are never split, nor are the rows of a group that share their prompt (the trainer
forwards such a prompt once: molt.train.packing.prefix_units), so a micro-batch's
budget counts the prompt once; see molt.train.packing for the balancing and filling rules.

Checkpoint: the next step number and the groups held for it (an Arrow file beside the
JSON), so a resumed run trains them in the same step.

End of stream: a partial step (fewer than ``groups_per_step`` groups) is dropped and
counted (``groups_dropped``), unless ``flush_partial: true`` trains it as a smaller
step. Example: 7 groups, 2 per step -> steps 0-2 emitted, 1 group dropped.

    pack: {class: stages.pack.Pack, config: {max_tokens_per_micro_batch: 4096}}  # world_size: the train stage's
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from molt.columns import row_lengths
from molt.runtime.edges import Barrier
from molt.models.images import row_images
from molt.runtime.spec import FOLLOWS_WORLD_SIZE
from molt.policy import policy_field
from molt.runtime.stage import Port, Service, StageConfig
from molt.train.packing import plan_step, prefix_units, unit_tokens

STEP_FIELDS = (
    pa.field("step", pa.int32(), metadata={b"doc": b"optimizer step this row trains in"}),
    pa.field("dp_rank", pa.int32(), metadata={b"doc": b"data-parallel rank that trains this row"}),
    pa.field("micro_batch", pa.int32(), metadata={b"doc": b"micro-batch index on its rank"}),
    pa.field("step_loss_tokens", pa.int64(), metadata={b"doc": b"loss_mask tokens of the whole step"}),
    pa.field("step_loss_seqs", pa.int64(), metadata={b"doc": b"rows with >= 1 loss_mask token in the step"}),
)


class Pack(Service):
    """Groups in, one placed step batch out per ``groups_per_step`` groups."""

    class Config(StageConfig):
        groups_per_step: int = policy_field("groups_per_step", 8, ge=1, description="prompt groups per optimizer "
                                            "step (molt.policy: policy.groups_per_step)")
        world_size: int = Field(1, ge=1, description="data-parallel ranks of the train stage; unset: the world_size "
                                "of the stage it feeds (molt.runtime.pipeline)", json_schema_extra=FOLLOWS_WORLD_SIZE)
        max_tokens_per_micro_batch: int = Field(4096, ge=1, description="token budget of one packed forward")
        flush_partial: bool = Field(False, description="train a last partial step instead of dropping it")

    config: Config
    inputs = {"in": Port(reads=("prompt_id", "sample_id", "token_ids", "loss_mask"))}
    outputs = {"out": Port(passes="in", writes=STEP_FIELDS)}

    def setup(self) -> None:
        self.groups: list[pa.RecordBatch] = []  # one batch per pending group, in arrival order
        self.step = 0

    async def run(self) -> None:
        while (item := await self.recv("in")) is not None:
            # 1) receive  2) split into groups  3) emit every complete step
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            self.groups += split_groups(item)
            while len(self.groups) >= self.config.groups_per_step:
                take, self.groups = self.groups[:self.config.groups_per_step], self.groups[self.config.groups_per_step:]
                await self.send("out", self.place(take))
        # 4) end of stream: the partial step
        if self.groups and self.config.flush_partial:
            self.log.info("end of stream: training a partial step of %d groups", len(self.groups))
            await self.send("out", self.place(self.groups))
        elif self.groups:
            self.log.warning("end of stream: dropping %d groups of a partial step (flush_partial: false)",
                             len(self.groups))
            self.metrics.count("groups_dropped", len(self.groups))
        self.metrics.flush_counters()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "num_groups_held": len(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.num_groups_held = state["step"], state["num_groups_held"]

    def save_checkpoint(self, folder: Path) -> None:
        if self.groups:  # held groups first, the JSON (written by super) marks completion
            folder.mkdir(parents=True, exist_ok=True)
            tmp = folder / f".{self.ctx.stage_id}.{self.ctx.replica}.arrow.tmp"
            with pa.OSFile(str(tmp), "wb") as sink, pa.ipc.new_file(sink, self.groups[0].schema) as writer:
                for group in self.groups:
                    writer.write_batch(group)
            tmp.rename(folder / f"{self.ctx.stage_id}.{self.ctx.replica}.arrow")
        super().save_checkpoint(folder)

    def load_checkpoint(self, folder: Path) -> None:
        super().load_checkpoint(folder)
        path = folder / f"{self.ctx.stage_id}.{self.ctx.replica}.arrow"
        if path.is_file():
            with pa.OSFile(str(path), "rb") as source:
                reader = pa.ipc.open_file(source)
                self.groups = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        if len(self.groups) != self.num_groups_held:
            raise ValueError(f"checkpoint {folder}: {path.name} holds {len(self.groups)} groups, its JSON "
                             f"{self.num_groups_held}; hint: the checkpoint was altered, resume from another one")

    def place(self, groups: list[pa.RecordBatch]) -> pa.RecordBatch:
        """One step batch of ``groups``, with the step columns, ordered by rank and micro-batch."""
        batch = pa.Table.from_batches(groups).combine_chunks().to_batches()[0]
        lengths = row_lengths(batch, "token_ids")
        # Rows sharing a prompt are one unit (the trainer forwards the prompt once): placed together.
        tokens = batch.column("token_ids").to_pylist()
        units = prefix_units(tokens, batch.column("loss_mask").to_pylist(), row_images(batch))  # images: as the trainer
        cost = unit_tokens(tokens, units)
        unit_plan = plan_step(cost, self.config.world_size, self.config.max_tokens_per_micro_batch)
        plan_rank, plan_micro = np.zeros(batch.num_rows, np.int32), np.zeros(batch.num_rows, np.int32)
        for u, (members, _) in enumerate(units):
            plan_rank[members], plan_micro[members] = unit_plan.dp_rank[u], unit_plan.micro_batch[u]
        if (over := max(cost, default=0)) > self.config.max_tokens_per_micro_batch:
            self.log.warning("a prompt group of %d tokens exceeds max_tokens_per_micro_batch %d; it is trained "
                             "alone", over, self.config.max_tokens_per_micro_batch)
        mask_counts = np.array([sum(m) for m in batch.column("loss_mask").to_pylist()], np.int64)
        n = batch.num_rows
        columns = [np.full(n, self.step, np.int32), plan_rank, plan_micro, np.full(n, int(mask_counts.sum()), np.int64),
                   np.full(n, int((mask_counts > 0).sum()), np.int64)]
        for f, values in zip(STEP_FIELDS, columns):
            batch = batch.append_column(f, pa.array(values, f.type))
        order = np.lexsort((plan_micro, plan_rank))
        self.metrics.log({"step": self.step, "groups": len(groups), "rows": n, "tokens": int(lengths.sum()),
                          "tokens_forwarded": sum(cost), "loss_tokens": int(mask_counts.sum()),
                          "micro_batches": unit_plan.num_micro_batches},
                         step=self.step)
        self.step += 1
        return batch.take(pa.array(order))


def split_groups(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The rows of each ``prompt_id``, one batch per group, in order of first appearance.

    Example: prompt_id [a, a, b, a] -> [rows 0, 1, 3], [row 2].
    """
    ids = batch.column("prompt_id")
    order = list(dict.fromkeys(ids.to_pylist()))
    return [batch.filter(pc.equal(ids, pid)) for pid in order]
