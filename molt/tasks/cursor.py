"""A resumable cursor over a task's records, as a ``torchdata.nodes`` node.

Replica ``r`` of ``R`` takes positions ``r, r+R, ...`` of each epoch's order: ``range(n)``,
permuted by ``random.Random(f"{seed}:{epoch}")`` if ``shuffle``; ``num_epochs`` None = forever.
An unbounded task is one endless epoch of indices ``r, r+R, ...``. The state ``{"epoch": e,
"position": p}`` names the next record, so a node reset to it skips and repeats none.
Example: n=5, R=2, no shuffle, 2 epochs: replica 1 yields 1, 3, 1, 3.
"""

from __future__ import annotations

import random
from typing import Any

from torchdata.nodes import Batcher, BaseNode

from molt.tasks.records import Record, Task


class PromptNode(BaseNode[Record]):
    """Records of one replica's share of ``task``, each with an added ``epoch`` field."""

    def __init__(self, task: Task, *, num_epochs: int | None = 1, shuffle: bool = True,
                 seed: int = 0, replica: int = 0, num_replicas: int = 1) -> None:
        super().__init__()
        assert 0 <= replica < num_replicas, (replica, num_replicas)
        self.task, self.num_epochs, self.shuffle, self.seed = task, num_epochs, shuffle, seed
        self.replica, self.num_replicas = replica, num_replicas
        self._epoch, self._position = 0, 0
        self._order: list[int] = []

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Start over, or continue from a state of :meth:`get_state`.

        Raises:
            ValueError: a state without integer ``epoch`` and ``position``.
        """
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "position": 0}
        if not all(isinstance(state.get(k), int) and state[k] >= 0 for k in ("epoch", "position")):
            raise ValueError(f"dataset cursor state needs integers 'epoch' and 'position' >= 0; "
                             f"got {state!r}; hint: pass what state_dict() returned")
        self._epoch, self._position = state["epoch"], state["position"]
        self._order = self._epoch_order(self._epoch)

    def _epoch_order(self, epoch: int) -> list[int]:
        n = self.task.num_records
        if n is None:
            return []
        indices = list(range(n))
        if self.shuffle:
            random.Random(f"{self.seed}:{epoch}").shuffle(indices)
        return indices[self.replica::self.num_replicas]

    def next(self) -> Record:
        if self.task.num_records is None:
            index = self._position * self.num_replicas + self.replica
        else:
            while self._position >= len(self._order) or self._epoch_done():
                if self._epoch_done() or not self._order:
                    raise StopIteration
                self._epoch, self._position = self._epoch + 1, 0
                self._order = self._epoch_order(self._epoch)
            index = self._order[self._position]
        self._position += 1
        return {**self.task.record(index), "epoch": self._epoch}

    def _epoch_done(self) -> bool:
        return self.num_epochs is not None and self._epoch >= self.num_epochs

    def get_state(self) -> dict[str, Any]:
        return {"epoch": self._epoch, "position": self._position}


def prompt_batches(node: PromptNode, batch_size: int) -> Batcher[Record]:
    return Batcher(node, batch_size=batch_size, drop_last=False)
