"""Agent and env test doubles: ChatAgents are plain OpenAI SDK code, as a user would write it."""

from __future__ import annotations

from molt.agents import ChatAgent
from molt.agents.base import Env, Result


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
