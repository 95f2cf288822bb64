"""A two-try env for the shapes task (:mod:`molt.tasks.shapes`): one hint after a wrong answer.

The policy sees the picture and question; its answer is read as the shapes grader
reads it (:func:`molt.tasks.graders.parse_count_colour`: first count, first colour word).
Right -> reward 1.0, episode over. Wrong on the first turn -> reward 0.0 and the reply
:data:`RETRY` (the episode goes on only when the rollout's ``max_turns`` >= 2). Wrong on
the second turn -> reward 0.0, episode over. Every step's ``info`` is
``{"count_right": bool, "colour_right": bool}``.

Example (answer "3 red"): "2 red" -> ``Result(0.0, RETRY, terminated=False, info={"count_right":
False, "colour_right": True})``; then "three red" -> ``Result(1.0, terminated=True)``.

YAML: ``stages.rollout.config.env: molt.agents.shapes_env.ShapesEnv``.
"""

from __future__ import annotations

from typing import Any

from molt.agents.base import Env, Message, Result
from molt.tasks.graders import parse_count_colour

RETRY = "Not quite. Look again: how many shapes, and what colour? Answer like: 3 red"
MAX_TRIES = 2


class ShapesEnv(Env):
    """Grade a count-and-colour answer; one retry with :data:`RETRY` after a wrong first answer."""

    def __init__(self) -> None:
        self.want: tuple[int | None, str | None] = (None, None)
        self.num_tries = 0

    def reset(self, task: dict[str, Any]) -> list[Message]:
        """The task's messages (the picture and question); remembers its ``answer`` ("3 red")."""
        self.want = parse_count_colour(str(task["answer"]))
        if None in self.want:
            raise ValueError(f"shapes env: answer must be like '3 red'; got {task['answer']!r}")
        self.num_tries = 0
        return list(task["messages"])

    def step(self, action: str) -> Result:
        """Reward 1.0 and end when right; else a retry (first turn) or reward 0.0 and end."""
        self.num_tries += 1
        count, colour = parse_count_colour(action)
        info = {"count_right": count == self.want[0], "colour_right": colour == self.want[1]}
        right = info["count_right"] and info["colour_right"]
        if right or self.num_tries >= MAX_TRIES:
            return Result(reward=float(right), terminated=True, info=info)
        return Result(reward=0.0, observation=RETRY, info=info)
