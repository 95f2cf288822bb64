"""A two-try env for the shapes task: one hint after a wrong answer.

Right: reward 1.0, the end. Wrong: reward 0.0 and, on the first turn, the reply `RETRY`.
Example (answer "3 red"): "2 red" -> ``Result(0.0, RETRY)``; "three red" -> ``Result(1.0,
terminated=True)``. YAML: ``stages.rollout.config.env: molt.agents.shapes_env.ShapesEnv``.
"""

from __future__ import annotations

from typing import Any

from molt.agents.base import Env, Message, Result
from molt.tasks.graders import parse_count_colour

RETRY = "Not quite. Look again: how many shapes, and what colour? Answer like: 3 red"
MAX_TRIES = 2


class ShapesEnv(Env):
    """Grade a count-and-colour answer; one retry after a wrong first answer."""

    def __init__(self) -> None:
        self.want: tuple[int | None, str | None] = (None, None)
        self.num_tries = 0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        """The task's messages; remembers its ``answer`` ("3 red")."""
        self.want = parse_count_colour(str(task["answer"]))
        if None in self.want:
            raise ValueError(f"shapes env: answer must be like '3 red'; got {task['answer']!r}")
        self.num_tries = 0
        return list(task["messages"])

    def step(self, action: str) -> Result:
        self.num_tries += 1
        count, colour = parse_count_colour(action)
        info = {"count_right": count == self.want[0], "colour_right": colour == self.want[1]}
        right = info["count_right"] and info["colour_right"]
        if right or self.num_tries >= MAX_TRIES:
            return Result(reward=float(right), terminated=True, info=info)
        return Result(reward=0.0, observation=RETRY, info=info)
