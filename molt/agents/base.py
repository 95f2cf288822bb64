"""The agent contract: an ``Env`` the framework drives turn by turn (molt.agents.episode).

The framework renders the messages with the model's chat template, generates the assistant's
turn, hands its decoded text to ``env.step`` and appends the reply as template tokens with
``loss_mask`` false. An env never sees token ids.
"""

from __future__ import annotations

import abc
import dataclasses
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from molt.agents.tools import Tool

# {"role": "system" | "user" | "assistant" | "tool", "content": text or parts (molt.models.images)}
Message = dict[str, Any]


@dataclasses.dataclass
class Result:
    """What ``Env.step`` returns: ``reward`` (the last step's is the rollout's; None: a reward
    stage grades), ``observation`` (the reply: a message, or a user message's text), whether the
    task ended (``terminated``) or a limit ended it (``truncated``), and JSON ``info``."""

    reward: float | None = None
    observation: Message | str | None = None
    terminated: bool = False
    truncated: bool = False
    info: dict[str, Any] = dataclasses.field(default_factory=dict)


class AgentError(RuntimeError):
    """An env raised: the rollout is counted as failed, the others go on."""


class Env(abc.ABC):
    """One episode of a task; a new instance per rollout.

    ``tools``: the tools the policy may call; the framework runs the calls, and ``step`` sees
    only the turns that call none."""

    tools: Sequence[Tool] = ()

    @abc.abstractmethod
    def reset(self, task: dict[str, Any]) -> list[Message]:
        """Start an episode of ``task`` (the row's metadata); return the opening messages."""

    @abc.abstractmethod
    def step(self, action: str) -> Result:
        """React to the policy's turn ``action`` (its decoded text)."""


class SingleTurn(Env):
    """The default env: the task's ``messages`` (or ``prompt``), one turn, no reward of its own."""

    def reset(self, task: dict[str, Any]) -> list[Message]:
        messages = task.get("messages")
        if not messages and task.get("prompt"):
            messages = [{"role": "user", "content": task["prompt"]}]
        if not messages:
            raise ValueError(f"task has neither 'messages' nor 'prompt'; got keys {sorted(task)}")
        return list(messages)

    def step(self, action: str) -> Result:
        return Result(terminated=True)


def episode_classes(env: str | None, agent: str | None,
                    where: str) -> tuple[type[Env], type | None]:
    """A rollout's ``env`` class (default `SingleTurn`) and ``agent`` class (or None).

    Raises:
        ValueError: both are set, or one cannot be imported, naming ``where``.
    """
    from molt.config import import_class

    if env and agent:
        raise ValueError(f"{where}: set env or agent, not both; got both")
    env_cls = import_class(env, f"{where}.env") if env else SingleTurn
    return env_cls, import_class(agent, f"{where}.agent") if agent else None
