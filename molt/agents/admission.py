"""Admission control and in-order release of prompt groups (DESIGN §4 and §8).

Released group j is trained in step j // groups_per_step; a *lost* group (no rollout
succeeded) or one a filter drops (`set_dropped`) leaves its place to the next. The next group
starts at engine version v only if

    v >= (admitted - lost - dropped) // groups_per_step - max_staleness

Example: groups_per_step 2, max_staleness 0: groups 0 and 1 start at version 0, group 2
waits for version 1 unless group 1 is lost or dropped. Each of R rollout replicas paces
``groups_per_step`` / R groups of a step.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Group = TypeVar("Group")


class GroupAdmission(Generic[Group]):
    """Counters and reorder buffer of one rollout replica; ``max_staleness`` None: no bound.

    Raises:
        ValueError: the step's ``groups_per_step`` does not split evenly among ``replicas``.
    """

    def __init__(self, groups_per_step: int, max_staleness: int | None, replicas: int = 1,
                 where: str = "groups_per_step") -> None:
        if groups_per_step % replicas:
            raise ValueError(f"{where}: {groups_per_step} groups a step do not split evenly among "
                             f"{replicas} rollout replicas, each of which paces its share")
        self.groups_per_step, self.max_staleness = groups_per_step // replicas, max_staleness
        self.num_admitted = self.num_released = self.num_lost = 0  # released counts lost ones too
        self.num_sent = 0  # released groups sent (`sent`): a barrier waits for them all
        self.dropped: dict[int, int] = {}  # filter replica -> this rollout's groups it dropped
        self.finished: dict[int, Group | None] = {}  # by admission index, until released in order
        self.min_version = 0  # a resumed rollout starts no group before its engine is back here
        self._changed = asyncio.Condition()

    def admissible(self, version: int) -> bool:
        """Whether a group may start at engine ``version`` (never below ``min_version``)."""
        if version < self.min_version:
            return False
        if self.max_staleness is None:
            return True
        position = self.num_admitted - self.num_lost - self.num_dropped
        return version >= position // self.groups_per_step - self.max_staleness

    @property
    def num_dropped(self) -> int:
        return sum(self.dropped.values())

    def set_dropped(self, filter_replica: int, num_dropped: int) -> None:
        """Take a filter replica's running count of drops (an old notice changes nothing)."""
        self.dropped[filter_replica] = max(self.dropped.get(filter_replica, 0), num_dropped)

    def take_drop_notices(self, notices: list[dict[str, Any]]) -> None:
        """`set_dropped` of each row of molt.schema.DROP_NOTICE_SCHEMA."""
        for notice in notices:
            self.set_dropped(notice["filter_replica"], notice["num_groups_dropped"])

    @property
    def running(self) -> int:
        return self.num_admitted - self.num_released - len(self.finished)

    async def until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()`` holds, checked again at each `changed`."""
        async with self._changed:
            await self._changed.wait_for(ready)

    async def changed(self) -> None:
        """Wake `until`: a group finished, new weights, a drop notice."""
        async with self._changed:
            self._changed.notify_all()

    def admit(self) -> int:
        self.num_admitted += 1
        return self.num_admitted - 1

    def finish(self, groups: list[tuple[int, Group | None]]) -> list[Group]:
        """Record (admission index, group or None = lost) pairs, in any order; return the groups
        now releasable, in admission order."""
        self.finished.update(groups)
        out = []
        while self.num_released in self.finished:
            group = self.finished.pop(self.num_released)
            if group is None:
                self.num_lost += 1
            else:
                out.append(group)
            self.num_released += 1
        return out

    def sent(self) -> None:
        """Every group `finish` released so far has been sent."""
        self.num_sent = self.num_released

    @property
    def drained(self) -> bool:
        """Every admitted group released and sent: a barrier, or the end, may pass."""
        return self.num_sent == self.num_admitted

    def state_dict(self) -> dict[str, Any]:
        """Counters at a barrier (nothing in flight)."""
        return {"num_groups": self.num_admitted, "num_lost": self.num_lost,
                "num_dropped": {str(r): n for r, n in self.dropped.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_admitted = self.num_released = self.num_sent = int(state["num_groups"])
        self.num_lost = int(state.get("num_lost", 0))
        self.dropped = {int(r): int(n) for r, n in state.get("num_dropped", {}).items()}
