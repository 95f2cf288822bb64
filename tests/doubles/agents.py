"""Agent and env test doubles: ChatAgents are plain OpenAI SDK code, as a user would write it."""

from __future__ import annotations

import json

from molt.agents import ChatAgent
from molt.agents.base import Env, Result
from molt.agents.tools import Tool
from molt.engines.base import Completion, Engine


class ThreeTurnAgent(ChatAgent):
    """Asks, then says 'again' twice, keeping the whole conversation; reward 1."""

    def run(self, client, task):
        messages = [{"role": "user", "content": task.get("question", "What is 2+2?")}]
        for i in range(3):
            reply = client.chat.completions.create(model="policy", messages=messages)
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": f"again {i}"}]
        return 1.0


class CompactingAgent(ChatAgent):
    """Second request rewrites the history into a summary: a new segment."""

    def run(self, client, task):
        first = client.chat.completions.create(model="policy", messages=[{"role": "user", "content": "Hi"}])
        summary = f"Earlier you said: {first.choices[0].message.content[:20]}"
        client.chat.completions.create(model="policy", messages=[{"role": "user", "content": summary}])
        return 0.5


class HotAgent(ChatAgent):
    """Asks for another temperature than the rollout samples with."""

    def run(self, client, task):
        client.chat.completions.create(model="policy", temperature=0.3, messages=[{"role": "user", "content": "x"}])
        return 1.0


class TopPAgent(ChatAgent):
    """Asks for nucleus sampling, which the rollout would not record faithfully."""

    def run(self, client, task):
        client.chat.completions.create(model="policy", top_p=0.5, messages=[{"role": "user", "content": "x"}])
        return 1.0


class LetterShareEnv(Env):
    """The task's messages (e.g. a shapes picture and question), scored by the share of letters in the
    answer: a reward that varies between a random policy's samples, so every group has a gradient."""

    def reset(self, task):
        return list(task["messages"])

    def step(self, action: str) -> Result:
        return Result(reward=sum(c.isalpha() for c in action) / max(len(action), 1), terminated=True)


class ScriptedEngine(Engine):
    """An engine that 'generates' the next of ``texts`` (tokenized by ``tokenizer``, then EOS), cut at
    max_new_tokens ("length"); logprob -0.5 per token at version 0. It records each request's prompt."""

    def __init__(self, tokenizer, texts):
        super().__init__()
        self.tok, self.texts, self.prompts, self.completions = tokenizer, list(texts), [], []

    async def _generate(self, request_id, prompt_token_ids, params, images=()):
        self.prompts.append(list(prompt_token_ids))
        ids = self.tok.encode(self.texts.pop(0), add_special_tokens=False) + [self.tok.eos_token_id]
        finish = "stop" if len(ids) <= params.max_new_tokens else "length"
        ids = ids[:params.max_new_tokens]
        self.completions.append(Completion(ids, [-0.5] * len(ids), [0] * len(ids), finish))
        return self.completions[-1]

    async def pause(self): ...

    async def resume(self): ...

    async def abort(self, request_id): ...

    def close(self): ...

    async def load_weights(self, path, version):
        raise NotImplementedError("a scripted engine has no weights")

    async def prompt_logprobs(self, token_ids):
        raise NotImplementedError("a scripted engine has no weights")


class Calculator(Tool):
    """``calculator``: the value of an arithmetic expression (digits, + - * / and parentheses only)."""

    name = "calculator"
    description = "Evaluate an arithmetic expression."
    parameters = {"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]}

    def call(self, arguments):
        expression = str(arguments["expression"])
        if not set(expression) <= set("0123456789+-*/() ."):
            raise ValueError(f"not arithmetic: {expression!r}")
        return str(eval(expression))  # noqa: S307 - checked to be arithmetic above


class CalculatorEnv(Env):
    """The task's question with a calculator; reward 1 when the final answer holds the task's ``answer``."""

    tools = (Calculator(),)

    def reset(self, task):
        self.answer = str(task["answer"])
        return [{"role": "user", "content": task["question"]}]

    def step(self, action):
        return Result(reward=float(self.answer in action), terminated=True)


class ToolAgent(ChatAgent):
    """The OpenAI SDK's tool loop, as its docs write it: ask with tools, run every call, send the results back,
    until a reply calls none; reward 1 when the last reply holds the task's ``answer``."""

    def run(self, client, task):
        tools, calculator = [Calculator.schema()], Calculator()
        messages = [{"role": "user", "content": task["question"]}]
        self.finish_reasons = []
        while True:
            reply = client.chat.completions.create(model="policy", messages=messages, tools=tools)
            message = reply.choices[0].message
            self.finish_reasons.append(reply.choices[0].finish_reason)
            messages.append(message)  # the SDK's own message object, as users append it
            if not message.tool_calls:
                return float(str(task["answer"]) in (message.content or ""))
            for call in message.tool_calls:
                result = calculator.call(json.loads(call.function.arguments))
                messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
