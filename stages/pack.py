"""Pack: gathers ``groups_per_step`` prompt groups per optimizer step and places their rows on
data-parallel ranks and micro-batches.

Input: batches of whole groups. Output: one batch per step, rows ordered by (dp_rank,
micro_batch), the input columns plus STEP_FIELDS (where each row trains; the step's loss
denominators). Rows are never split, nor are the rows of a group that share their prompt, which
the trainer forwards and a micro-batch's budget counts once (molt.train.packing). Checkpoint:
the next step and the groups held for it (an Arrow file beside the JSON). At end of stream a
partial step is dropped and counted (``groups_dropped``), unless ``flush_partial: true`` trains
it.
Example: 7 groups, 2 per step -> steps 0-2 emitted, 1 group dropped.

    pack: {class: stages.pack.Pack, config: {max_tokens_per_micro_batch: 4096}}
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

STEP_FIELDS = tuple(pa.field(name, type_, metadata={b"doc": doc}) for name, type_, doc in (
    ("step", pa.int32(), b"optimizer step this row trains in (0, 1, ...)"),
    ("dp_rank", pa.int32(), b"data-parallel rank that trains this row"),
    ("micro_batch", pa.int32(), b"micro-batch index on its rank; every rank has as many"),
    ("step_loss_tokens", pa.int64(), b"loss_mask tokens of the whole step (loss denominator)"),
    ("step_loss_seqs", pa.int64(), b"rows with >= 1 loss_mask token in the step (seq-mean "
                                   b"denominator)")))


class Pack(Service):
    """Groups in, one placed step batch out per ``groups_per_step`` groups."""

    class Config(StageConfig):
        groups_per_step: int = policy_field("groups_per_step", 8, ge=1)
        world_size: int = Field(1, ge=1, json_schema_extra=FOLLOWS_WORLD_SIZE,
                                description="ranks of the train stage; unset: its world_size")
        max_tokens_per_micro_batch: int = Field(4096, ge=1, description="of one packed forward")
        flush_partial: bool = Field(False, description="train a last partial step, not drop it")

    config: Config
    inputs = {"in": Port(reads=("prompt_id", "sample_id", "token_ids", "loss_mask"))}
    outputs = {"out": Port(passes="in", writes=STEP_FIELDS)}

    def setup(self) -> None:
        self.groups: list[pa.RecordBatch] = []  # one batch per pending group, in arrival order
        self.step = 0

    async def run(self) -> None:
        per_step = self.config.groups_per_step
        while (item := await self.recv("in")) is not None:
            # 1) receive  2) split into groups  3) emit every complete step
            if isinstance(item, Barrier):
                await self.barrier(item.step)
                continue
            self.groups += split_groups(item)
            while len(self.groups) >= per_step:
                take, self.groups = self.groups[:per_step], self.groups[per_step:]
                await self.send("out", self.place(take))
        # 4) end of stream: the partial step
        if self.groups and self.config.flush_partial:
            self.log.info("end of stream: training a partial step of %d groups", len(self.groups))
            await self.send("out", self.place(self.groups))
        elif self.groups:
            self.log.warning("end of stream: dropping %d groups of a partial step (flush_partial: "
                             "false)", len(self.groups))
            self.metrics.count("groups_dropped", len(self.groups))
        self.metrics.flush_counters()

    def state_dict(self) -> dict[str, Any]:
        return {"step": self.step, "num_groups_held": len(self.groups)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step, self.num_groups_held = state["step"], state["num_groups_held"]

    def save_checkpoint(self, folder: Path) -> None:
        if self.groups:  # the held groups first: the JSON (written by super) marks completion
            folder.mkdir(parents=True, exist_ok=True)
            path = folder / f"{self.ctx.stage_id}.{self.ctx.replica}.arrow"
            tmp = path.with_name(f".{path.name}.tmp")
            with pa.OSFile(str(tmp), "wb") as f, pa.ipc.new_file(f, self.groups[0].schema) as out:
                for group in self.groups:
                    out.write_batch(group)
            tmp.rename(path)
        super().save_checkpoint(folder)

    def load_checkpoint(self, folder: Path) -> None:
        super().load_checkpoint(folder)
        path = folder / f"{self.ctx.stage_id}.{self.ctx.replica}.arrow"
        if path.is_file():
            with pa.OSFile(str(path), "rb") as source:
                reader = pa.ipc.open_file(source)
                self.groups = [reader.get_batch(i) for i in range(reader.num_record_batches)]
        if len(self.groups) != self.num_groups_held:
            raise ValueError(f"checkpoint {folder}: {path.name} holds {len(self.groups)} groups, "
                             f"its JSON {self.num_groups_held}; hint: the checkpoint was altered, "
                             "resume from another one")

    def place(self, groups: list[pa.RecordBatch]) -> pa.RecordBatch:
        """The step batch of ``groups``: STEP_FIELDS added, ordered by rank and micro-batch."""
        c, batch = self.config, pa.Table.from_batches(groups).combine_chunks().to_batches()[0]
        tokens, masks = batch.column("token_ids").to_pylist(), batch.column("loss_mask").to_pylist()
        # Rows sharing a prompt are one unit, placed together (images: as the trainer keys them).
        units = prefix_units(tokens, masks, row_images(batch))
        cost = unit_tokens(tokens, units)
        plan = plan_step(cost, c.world_size, c.max_tokens_per_micro_batch)
        n = batch.num_rows
        rank, micro = np.zeros(n, np.int32), np.zeros(n, np.int32)
        for u, (members, _) in enumerate(units):
            rank[members], micro[members] = plan.dp_rank[u], plan.micro_batch[u]
        if (over := max(cost, default=0)) > c.max_tokens_per_micro_batch:
            self.log.warning("a prompt group of %d tokens exceeds max_tokens_per_micro_batch %d; "
                             "it is trained alone", over, c.max_tokens_per_micro_batch)
        mask_counts = np.array([sum(m) for m in masks], np.int64)
        loss_tokens = int(mask_counts.sum())
        columns = [np.full(n, self.step, np.int32), rank, micro, np.full(n, loss_tokens, np.int64),
                   np.full(n, int((mask_counts > 0).sum()), np.int64)]
        for f, values in zip(STEP_FIELDS, columns):
            batch = batch.append_column(f, pa.array(values, f.type))
        self.metrics.log({"step": self.step, "groups": len(groups), "rows": n,
                          "tokens": int(row_lengths(batch, "token_ids").sum()),
                          "tokens_forwarded": sum(cost), "loss_tokens": loss_tokens,
                          "micro_batches": plan.num_micro_batches}, step=self.step)
        self.step += 1
        return batch.take(pa.array(np.lexsort((micro, rank))))


def split_groups(batch: pa.RecordBatch) -> list[pa.RecordBatch]:
    """The rows of each ``prompt_id``, one batch per group, in order of first appearance.

    Example: prompt_id [a, a, b, a] -> [rows 0, 1, 3], [row 2].
    """
    ids = batch.column("prompt_id")
    return [batch.filter(pc.equal(ids, pid)) for pid in dict.fromkeys(ids.to_pylist())]
