"""In-process handoff between a train stage and the stages fused into it.

A stage fused with ``colocate_with: train`` (the weight broadcast) runs in every
train rank's process and needs the rank's FSDP2 model for collectives such as
``get_model_state_dict``. Collectives must run in the same order on every rank, so
the train stage waits, after sending step k's record, until each fused consumer has
acknowledged it (done its collectives for step k) before it receives step k+1:

    train:     step k -> send record k -> await acked(k)  -> recv k+1 (a collective) ...
    broadcast: recv record k -> export (collective) -> ack(k)

Example: ``h = policy_handle("train"); h.consumers += 1`` in the broadcast's setup;
``h.ack(3)`` after exporting version 3; the train stage awaits ``h.wait_acked(3)``.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

_HANDLES: dict[str, "PolicyHandle"] = {}


@dataclass
class PolicyHandle:
    """The policy model of one train stage in this process, and the acks of its consumers."""

    model: Any = None
    consumers: int = 0
    acks: dict[int, int] = field(default_factory=dict)  # step -> consumers that acked it
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    export_seconds: float = 0.0  # the last weight export's duration (set by the broadcast)

    def ack(self, step: int) -> None:
        """A consumer finished its work (and collectives) for ``step``."""
        self.acks[step] = self.acks.get(step, 0) + 1
        self.changed.set()

    async def wait_acked(self, step: int) -> None:
        """Wait until every registered consumer acked ``step``."""
        while self.acks.get(step, 0) < self.consumers:
            self.changed.clear()
            await self.changed.wait()
        self.acks.pop(step, None)


def policy_handle(stage_id: str) -> PolicyHandle:
    """The handle of train stage ``stage_id`` in this process (created on first use)."""
    if stage_id not in _HANDLES:
        _HANDLES[stage_id] = PolicyHandle()
    return _HANDLES[stage_id]


def drop_handle(stage_id: str) -> None:
    """Forget the handle of ``stage_id`` (the train stage's close)."""
    _HANDLES.pop(stage_id, None)
