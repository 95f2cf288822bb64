"""Admission control and in-order release of prompt groups (DESIGN §4 and §8).

The rollout admits prompt groups one by one and releases finished groups in the order
they were admitted, so released group j is trained in step j // groups_per_step. A
group none of whose rollouts succeeded is *lost*: it releases nothing, and the next
admitted group takes its place in the step. A group that a filter downstream drops
(DAPO's dynamic sampling, stages.dynamic_sampling) never reaches the trainer either:
the filter broadcasts its running count of dropped groups back to the rollout
(`set_dropped`), and the next group takes the dropped one's place. Admission keeps
every token within ``max_staleness`` versions of the trainer: the next group (its
position in the trainer's stream ``admitted - lost - dropped``, counting in-flight
groups as if they succeed and are kept) starts at engine version v only if

    v >= (admitted - lost - dropped) // groups_per_step - max_staleness

A drop the rollout has not heard of yet only makes it wait longer, never admit a
group too stale.

Example: groups_per_step 2, max_staleness 0: groups 0 and 1 start at version 0, group
2 waits for version 1; if group 1 is lost, or dropped by the filter, group 2 starts at
version 0 (it fills step 0). With R rollout replicas each paces its share of a step:
``groups_per_step`` here is the step's groups / R (64 groups, 4 replicas: 16 each).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Generic, TypeVar

Group = TypeVar("Group")


class GroupAdmission(Generic[Group]):
    """Counters and the reorder buffer of one rollout replica (module docstring).

    ``max_staleness`` None admits without bound. `finish` takes (admission index, group
    or None = lost) pairs in any order and returns the groups now releasable, in order.

    Raises:
        ValueError: ``groups_per_step`` (the whole step's) does not split evenly among ``replicas``.
    """

    def __init__(self, groups_per_step: int, max_staleness: int | None, replicas: int = 1,
                 where: str = "groups_per_step") -> None:
        if groups_per_step % replicas:
            raise ValueError(f"{where}: {groups_per_step} groups a step do not split evenly among "
                             f"{replicas} rollout replicas, each of which paces its share")
        self.groups_per_step, self.max_staleness = groups_per_step // replicas, max_staleness
        self.num_admitted = self.num_released = self.num_lost = 0  # released counts lost ones too
        self.num_sent = 0  # released groups the rollout has sent (`sent`): a barrier waits for them all
        self.dropped: dict[int, int] = {}  # filter replica -> this rollout's groups it dropped (`set_dropped`)
        self.finished: dict[int, Group | None] = {}  # by admission index, until released in order
        self.min_version = 0  # a resumed rollout's: no group starts before its engine is back at this version
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
        """Released groups that filters downstream dropped, as far as their notices have come."""
        return sum(self.dropped.values())

    def set_dropped(self, filter_replica: int, num_dropped: int) -> None:
        """Take filter replica ``filter_replica``'s running count of groups it dropped. Counts only
        grow: an older or repeated notice (one re-sent after a resume) changes nothing."""
        self.dropped[filter_replica] = max(self.dropped.get(filter_replica, 0), num_dropped)

    def take_drop_notices(self, notices: list[dict[str, Any]]) -> None:
        """`set_dropped` of each notice (rows of molt.schema.DROP_NOTICE_SCHEMA, a rollout's ``drops`` input)."""
        for notice in notices:
            self.set_dropped(notice["filter_replica"], notice["num_groups_dropped"])

    @property
    def running(self) -> int:
        """Groups admitted and not yet finished (0 at a barrier: every admitted group was released)."""
        return self.num_admitted - self.num_released - len(self.finished)

    async def until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()`` holds, checked again at each `changed`."""
        async with self._changed:
            await self._changed.wait_for(ready)

    async def changed(self) -> None:
        """Something admission waits on changed: a group finished, new weights, a drop notice."""
        async with self._changed:
            self._changed.notify_all()

    def admit(self) -> int:
        """The admission index of a new group."""
        self.num_admitted += 1
        return self.num_admitted - 1

    def finish(self, groups: list[tuple[int, Group | None]]) -> list[Group]:
        """Record finished groups; return those releasable now, in admission order (lost ones skipped)."""
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
        """The rollout sent every group `finish` released so far (a send may wait for credit)."""
        self.num_sent = self.num_released

    @property
    def drained(self) -> bool:
        """Every admitted group released and sent: a barrier, or the end, may pass."""
        return self.num_sent == self.num_admitted

    def state_dict(self) -> dict[str, Any]:
        """Counters at a barrier (nothing in flight: every admitted group was released)."""
        return {"num_groups": self.num_admitted, "num_lost": self.num_lost,
                "num_dropped": {str(r): n for r, n in self.dropped.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_admitted = self.num_released = self.num_sent = int(state["num_groups"])
        self.num_lost = int(state.get("num_lost", 0))
        self.dropped = {int(r): int(n) for r, n in state.get("num_dropped", {}).items()}
