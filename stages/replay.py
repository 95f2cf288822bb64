"""ReplaySource: re-emits a recorded edge, batch for batch, bit-identical.

``path`` is a recorded ``.arrow`` file or a folder of them (``RUN_DIR/record/EDGE``, one per
producer replica, read in name order). The output schema is the recording's, so a replayed edge
is checked against its consumers at load like a live one. ``skip`` drops the first batches of
named files (``{"rollout.0.arrow": 12}``), for ``molt replay --from-step``.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator

import pyarrow as pa
from pydantic import Field

from molt.runtime.recording import read_batches, read_schema, recording_files
from molt.runtime.stage import Port, Source, StageConfig


class ReplaySource(Source):
    """Re-emits every batch of a recording, in order."""

    class Config(StageConfig):
        path: str
        skip: dict[str, int] = Field(default_factory=dict)  # file name -> leading batches to skip

    config: Config

    @classmethod
    def ports(cls, config: StageConfig) -> tuple[dict[str, Port], dict[str, Port]]:
        assert isinstance(config, cls.Config)
        return {}, {"out": Port(schema=read_schema(config.path))}

    def setup(self) -> None:
        if self.ctx.num_replicas != 1:
            raise ValueError(f"stages.{self.ctx.stage_id}.replicas: a replay source re-emits one "
                             f"recording in order; got {self.ctx.num_replicas} replicas; hint: "
                             "use 1")

    def generate(self) -> Iterator[pa.RecordBatch]:
        for path in recording_files(self.config.path):
            skip = self.config.skip.get(path.name, 0)
            yield from itertools.islice(read_batches(path), skip, None)
