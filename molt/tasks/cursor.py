"""A resumable cursor over a task's records, as a ``torchdata.nodes`` node.

:class:`PromptNode` yields records in a fixed order and its state is two integers,
``{"epoch": e, "position": p}``: the next record is the ``p``-th of this replica's
share of epoch ``e``. Saving the state after any number of records and resetting a
fresh node to it continues with exactly the next record: none skipped, none repeated.

Order of a finite task with ``n`` records, for replica ``r`` of ``R``:

1. epoch ``e`` permutes ``range(n)`` with ``random.Random(f"{seed}:{e}")`` if
   ``shuffle``, else keeps ``0..n-1``; every replica computes the same permutation;
2. replica ``r`` takes positions ``r, r+R, r+2R, ...`` of it, so the replicas' shares
   are disjoint and together cover the epoch;
3. after ``num_epochs`` epochs (None = forever) the node is exhausted.

An unbounded task (``num_records`` None) is one endless epoch: replica ``r`` takes
indices ``r, r+R, ...``; ``shuffle`` does not apply.

Example: n=5, R=2, no shuffle, 2 epochs: replica 0 yields 0, 2, 4, 0, 2, 4; replica 1
yields 1, 3, 1, 3. :func:`prompt_batches` groups records into lists with a
``Batcher``; its ``state_dict()`` is ``{"source": {"epoch": e, "position": p}}``.
"""

from __future__ import annotations

import random
from typing import Any

from torchdata.nodes import Batcher, BaseNode

from molt.tasks.records import Record, Task


class PromptNode(BaseNode[Record]):
    """Records of one replica's share of ``task``, each with an added ``epoch`` field."""

    def __init__(self, task: Task, *, num_epochs: int | None = 1, shuffle: bool = True, seed: int = 0,
                 replica: int = 0, num_replicas: int = 1) -> None:
        super().__init__()
        assert 0 <= replica < num_replicas, (replica, num_replicas)
        self.task, self.num_epochs, self.shuffle, self.seed = task, num_epochs, shuffle, seed
        self.replica, self.num_replicas = replica, num_replicas
        self._epoch, self._position = 0, 0
        self._order: list[int] = []

    def reset(self, initial_state: dict[str, Any] | None = None) -> None:
        """Start over, or continue from a state that :meth:`get_state` returned.

        Raises:
            ValueError: a state without integer ``epoch`` and ``position``.
        """
        super().reset(initial_state)
        state = initial_state or {"epoch": 0, "position": 0}
        if not all(isinstance(state.get(k), int) and state[k] >= 0 for k in ("epoch", "position")):
            raise ValueError(f"dataset cursor state needs integers 'epoch' and 'position' >= 0; got {state!r}; "
                             "hint: pass what state_dict() returned")
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
    """Lists of up to ``batch_size`` records (the last one may be shorter)."""
    return Batcher(node, batch_size=batch_size, drop_last=False)
