"""Admission control and in-order release of prompt groups (DESIGN §4 and §8).

The rollout admits prompt groups one by one and releases finished groups in the order
they were admitted, so released group j is trained in step j // groups_per_step. A
group none of whose rollouts succeeded is *lost*: it releases nothing, and the next
admitted group takes its place in the step. Admission keeps every token within
``max_staleness`` versions of the trainer: the next group (release position
``admitted - lost``, counting in-flight groups as if they succeed) starts at engine
version v only if

    v >= (admitted - lost) // groups_per_step - max_staleness

Example: groups_per_step 2, max_staleness 0: groups 0 and 1 start at version 0, group
2 waits for version 1; if group 1 is lost, group 2 starts at version 0 (it fills step 0).
"""

from __future__ import annotations

from typing import Any, Generic, TypeVar

Group = TypeVar("Group")


class GroupAdmission(Generic[Group]):
    """Counters and the reorder buffer of one rollout replica (module docstring).

    ``max_staleness`` None admits without bound. `finish` takes (admission index, group
    or None = lost) pairs in any order and returns the groups now releasable, in order.
    """

    def __init__(self, groups_per_step: int, max_staleness: int | None) -> None:
        self.groups_per_step, self.max_staleness = groups_per_step, max_staleness
        self.num_admitted = self.num_released = self.num_lost = 0  # released counts lost ones too
        self.finished: dict[int, Group | None] = {}  # by admission index, until released in order

    def admissible(self, version: int) -> bool:
        """Whether a group may start at engine ``version``."""
        if self.max_staleness is None:
            return True
        return version >= (self.num_admitted - self.num_lost) // self.groups_per_step - self.max_staleness

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

    def state_dict(self) -> dict[str, Any]:
        """Counters at a barrier (nothing in flight: every admitted group was released)."""
        return {"num_groups": self.num_admitted, "num_lost": self.num_lost}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.num_admitted = self.num_released = int(state["num_groups"])
        self.num_lost = int(state.get("num_lost", 0))
