"""ChatAgent over the loopback OpenAI endpoint, driven by the real openai SDK."""

import asyncio

import pytest

from molt.agents import AgentError, ChatAgent, ChatServer, ChatTemplate
from molt.engines.base import SamplingParams
from molt.runtime.recording import read_batches
from tests.conftest import run_spec
from tests.doubles.agents import CompactingAgent, HotAgent, ThreeTurnAgent
from tests.test_rollout import Recording, rollout_pipeline


@pytest.fixture(scope="module")
def chat(tiny_chat_model):
    from transformers import AutoTokenizer

    return ChatTemplate(AutoTokenizer.from_pretrained(tiny_chat_model))


def serve(model, chat, agent, max_turns=5, engine=None):
    engine = engine or Recording(str(model))

    async def main():
        server = ChatServer(engine, chat, SamplingParams(temperature=1.0, max_new_tokens=5, seed=2), max_turns, 400)
        try:
            return await server.run_episode(agent, {"question": "What is 2+2?"}, "g#0/0")
        finally:
            await server.stop()

    return asyncio.run(main()), engine.completions


def test_a_chat_agent_conversation_is_engine_tokens_plus_template_deltas(tiny_chat_model, chat):
    ep, (c1, c2, c3) = serve(tiny_chat_model, chat, ThreeTurnAgent())
    [seg] = ep.segments
    prompt = chat.prompt_ids([{"role": "user", "content": "What is 2+2?"}])
    probe = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]
    d1 = chat.turn_delta_ids(probe, [{"role": "user", "content": "again 0"}], c1.finish_reason == "stop")
    d2 = chat.turn_delta_ids(probe, [{"role": "user", "content": "again 1"}], c2.finish_reason == "stop")
    assert seg.token_ids == prompt + c1.token_ids + d1 + c2.token_ids + d2 + c3.token_ids
    assert sum(seg.loss_mask) == len(c1.token_ids) + len(c2.token_ids) + len(c3.token_ids)
    assert ep.score == 1.0 and ep.num_turns == 3 and ep.completion_text == chat.decode(c3.token_ids)


def test_a_rewritten_history_starts_a_new_segment(tiny_chat_model, chat):
    ep, (c1, c2) = serve(tiny_chat_model, chat, CompactingAgent())
    assert len(ep.segments) == 2 and ep.score == 0.5
    assert ep.segments[0].token_ids[-len(c1.token_ids):] == c1.token_ids
    assert ep.segments[1].token_ids[-len(c2.token_ids):] == c2.token_ids
    summary = chat.decode(ep.segments[1].token_ids)
    assert "Earlier you said" in summary


def test_a_request_for_another_temperature_fails_the_rollout(tiny_chat_model, chat):
    with pytest.raises(AgentError, match=r"BadRequestError.*temperature 0.3 differs from the rollout's 1.0"):
        serve(tiny_chat_model, chat, HotAgent())


def test_the_turn_budget_fails_an_agent_that_keeps_talking(tiny_chat_model, chat):
    with pytest.raises(AgentError, match=r"turn budget exhausted: max_turns is 2"):
        serve(tiny_chat_model, chat, ThreeTurnAgent(), max_turns=2)


def test_a_chat_agent_runs_in_the_rollout_stage(tiny_chat_model, tmp_path, no_orphans):
    spec = rollout_pipeline(tiny_chat_model, agent="tests.doubles.agents.ThreeTurnAgent", max_turns=3)
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary["error"]
    rows = [r for b in read_batches(tmp_path / "run" / "record" / "rollout.out--sink.in") for r in b.to_pylist()]
    assert len(rows) == 18 and all(r["score"] == 1.0 for r in rows)
    assert all(r["token_ids"].count(1) >= 5 for r in rows), "system, user, assistant x3 turns: <|im_start|> each"


def test_sampling_settings_the_rollout_would_not_record_are_refused(tiny_chat_model, chat):
    from tests.doubles.agents import TopPAgent

    with pytest.raises(AgentError, match=r"unsupported options \['top_p'\]"):
        serve(tiny_chat_model, chat, TopPAgent())


class Options(ChatAgent):
    """One request with ``options`` in its body (the SDK's extra_body: any key reaches the server)."""

    def __init__(self, options):
        self.options = options

    def run(self, client, task):
        client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}],
                                       extra_body=self.options)
        return 1.0


@pytest.mark.parametrize("options", [{"typical_p": 0.9}, {"top_a": 0.1}, {"response_format": {"type": "json_object"}},
                                     {"top_k": 5}, {"top_k": False}, {"logprobs": True}, {"seed": 3}, {"stop": ["\n"]},
                                     {"parallel_tool_calls": False}])
def test_every_option_the_server_does_not_apply_is_refused_naming_it(tiny_chat_model, chat, options):
    [key] = options
    with pytest.raises(AgentError, match=rf"BadRequestError.*unsupported options \['{key}'\]"):
        serve(tiny_chat_model, chat, Options(options))


@pytest.mark.parametrize("options", [{"top_k": 0}, {"top_k": -1}, {"top_p": 1.0}, {"stop": None}, {"stream": False},
                                     {"response_format": {"type": "text"}}, {"logprobs": False}, {"user": "u1"},
                                     {"max_completion_tokens": 3, "presence_penalty": 0}])
def test_off_values_and_the_options_it_applies_are_accepted(tiny_chat_model, chat, options):
    ep, [completion] = serve(tiny_chat_model, chat, Options(options))
    assert ep.score == 1.0 and len(completion.token_ids) <= 5


def test_responses_report_token_usage(tiny_chat_model, chat):
    from molt.agents import ChatAgent

    class Usage(ChatAgent):
        def run(self, client, task):
            reply = client.chat.completions.create(model="p", messages=[{"role": "user", "content": "hi"}])
            return float(reply.usage.completion_tokens)

    ep, [c1] = serve(tiny_chat_model, chat, Usage())
    assert ep.score == len(c1.token_ids)


def test_an_engine_that_dies_under_an_agent_is_reported_as_the_engines_death_not_the_agents(tiny_chat_model, chat):
    from molt.engines.base import EngineDeadError

    class Dead(Recording):
        async def generate(self, *args, **kwargs):
            raise EngineDeadError("the engine core died (a test double)")

    with pytest.raises(EngineDeadError, match="the engine core died"):  # the rollout restarts it and runs again
        serve(tiny_chat_model, chat, ThreeTurnAgent(), engine=Dead(str(tiny_chat_model)))
