"""The agent contract: an ``Env`` the framework drives turn by turn.

The framework owns the generation loop (:func:`molt.agents.episode.run_episode`):
it renders the task's messages with the model's own chat template, asks the engine
for the assistant's turn (token ids in, token ids out), hands the decoded text to
``env.step``, and appends the environment's reply as chat-template tokens with
``loss_mask`` false. An env never sees or produces token ids.

A minimal env (one turn, graded)::

    class Echo(Env):
        def reset(self, task):      return task["messages"]
        def step(self, action):     return Result(reward=float(task_answer in action), terminated=True)
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.agents.tools import Tool

# {"role": "user" | "assistant" | "system" | "tool", "content": str | list of text/image parts (molt.models.images)}
Message = dict[str, Any]


@dataclasses.dataclass
class Result:
    """What ``Env.step`` returns after the policy's turn.

    reward: the score of the episode so far; the last step's reward is the
        episode's ``score`` (one reward per rollout, shared by its segments);
        None = the env does not grade (a reward stage does).
    observation: the environment's reply (a user or tool message, or its text as
        a user message); ignored when the episode ends.
    terminated: the task ended (solved or failed). truncated: a limit ended it.
    info: anything JSON-serialisable; stored in the row's ``metadata``.
    """

    reward: float | None = None
    observation: Message | str | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class AgentError(RuntimeError):
    """An env raised: the rollout is counted as failed, the others go on."""


class Env(abc.ABC):
    """One episode of a task. A new instance is made for every rollout.

    ``tools``: the tools the policy may call (molt.agents.tools.Tool; a class attribute or set
    in ``__init__``); the framework renders them into the prompt, runs the calls and returns their
    results, and ``step`` sees only the turns that call none (molt.agents.episode)."""

    tools: Sequence[Tool] = ()

    @abc.abstractmethod
    def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start an episode of ``task`` (the dataset row's metadata); return the
        opening messages (e.g. system + user)."""

    @abc.abstractmethod
    def step(self, action: str) -> Result:
        """React to the policy's turn ``action`` (decoded text of its tokens)."""


class SingleTurn(Env):
    """The default env: the task's ``messages`` as the prompt, one policy turn, no
    reward of its own (a reward stage grades the completion afterwards)."""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        messages = task.get("messages")
        if not messages and task.get("prompt"):
            messages = [{"role": "user", "content": task["prompt"]}]
        if not messages:
            raise ValueError(f"task has neither 'messages' nor 'prompt'; got keys {sorted(task)}")
        return list(messages)

    def step(self, action: str) -> Result:
        return Result(terminated=True)


def episode_classes(env: str | None, agent: str | None, where: str) -> tuple[type[Env], type | None]:
    """A rollout's ``env`` class (default `SingleTurn`) and ``agent`` class (or None), from their import paths,
    so that a typo fails at load.

    Raises:
        ValueError: both are set, or one cannot be imported (molt.config.import_class), naming ``where``.
    """
    from molt.config import import_class

    if env and agent:
        raise ValueError(f"{where}: set env or agent, not both; got both")
    return (import_class(env, f"{where}.env") if env else SingleTurn), (import_class(agent, f"{where}.agent")
                                                                         if agent else None)
