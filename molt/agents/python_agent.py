"""PythonAgent: the shipped tool-using agent, OpenAI SDK code with the sandboxed ``python`` tool.

It asks until a reply calls no tool (or ``max_calls`` have); the reward is the math grader's
score of the last reply.

    rollout: {config: {agent: molt.agents.python_agent.PythonAgent, max_turns: 4}}
"""

from __future__ import annotations

import functools
import json
import re
from typing import Any, ClassVar

from molt.agents.base import Message
from molt.agents.openai_server import ChatAgent
from molt.agents.sandbox import PythonTool, Sandbox
from molt.agents.tools import ToolCall, run_tool
from molt.tasks.graders import MathGrader

SYSTEM = ("You are a careful assistant. Compute with the python tool, then answer with just the "
          "number.")


@functools.cache
def shared_sandbox() -> Sandbox:
    """The process's sandbox, shared by its rollouts (a Sandbox is thread-safe)."""
    return Sandbox()


class PythonAgent(ChatAgent):
    """The module docstring's agent."""

    max_calls: ClassVar[int] = 3

    def run(self, client: Any, task: dict[str, Any]) -> float:
        python = PythonTool(shared_sandbox())
        messages: list[Any] = [{"role": "system", "content": SYSTEM}, *task["messages"]]
        for _ in range(self.max_calls + 1):
            reply = client.chat.completions.create(model="policy", messages=messages,
                                                   tools=[python.schema()])
            message = reply.choices[0].message
            messages.append(message)
            if not message.tool_calls:  # the answer
                break
            for call in message.tool_calls:
                parsed = ToolCall(call.id, call.function.name, json.loads(call.function.arguments))
                result = run_tool({"python": python}, parsed)
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return MathGrader().grade(message.content or "", str(task["answer"])).score

    @classmethod
    def demonstration(cls, task: dict[str, Any]) -> tuple[list[Message], list[dict[str, Any]]]:
        """A right conversation for ``task`` (a call printing its ``A op B``) and its tools.

        Raises:
            ValueError: the task's question holds no ``A op B`` expression.
        """
        found = re.findall(r"(\d+ [-+*] \d+)", str(task["messages"][-1]["content"]))
        if not found:
            raise ValueError(f"task {task.get('prompt_id')!r}: no 'A op B' expression in its "
                             "question to demonstrate")
        call = ToolCall("call_1_0", PythonTool.name, {"code": f"print({found[-1]})"})
        return [{"role": "system", "content": SYSTEM}, *task["messages"],
                {"role": "assistant", "content": None, "tool_calls": [call.openai()]},
                {"role": "tool", "tool_call_id": call.id, "content": f"{task['answer']}\n"},
                {"role": "assistant", "content": str(task["answer"])}], [PythonTool.schema()]
