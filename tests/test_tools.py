"""Tool calling: the hermes parser, tools in chat templates (the model's own and the fallback), an Env's tools
and the OpenAI endpoint's tools/tool_calls, with every token of a call the engine's own."""

import asyncio
import json

import pytest

from molt.agents import ChatAgent, ChatServer, ChatTemplate, run_episode
from molt.agents.tools import HermesParser, ToolCall, fallback_messages, run_tool, tool_parser
from molt.engines.base import SamplingParams
from tests.doubles.agents import Calculator, CalculatorEnv, ScriptedEngine, ToolAgent

CALL = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "123*45"}}\n</tool_call>'
TASK = {"question": "What is 123*45?", "answer": 5535}
# A Qwen2.5-style template that renders tools (SmolLM2-135M-Instruct's does not)
NATIVE = ("{% if tools %}<|im_start|>system\nYou are helpful.\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}"
          "</tools><|im_end|>\n{% endif %}{% for m in messages %}{% if m.role == 'tool' %}<|im_start|>user\n"
          "<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n{% elif m.role == 'assistant' and "
          "m.tool_calls %}<|im_start|>assistant\n{{ m.content }}{% for c in m.tool_calls %}<tool_call>\n{\"name\": \""
          "{{ c.function.name }}\", \"arguments\": {{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}"
          "<|im_end|>\n{% else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tokenizer(tiny_chat_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_chat_model)


@pytest.fixture(scope="module")
def chat(tokenizer):
    return ChatTemplate(tokenizer)


def test_the_hermes_parser_reads_one_or_several_calls_and_the_text_around_them():
    parse = HermesParser().parse
    turn = parse(f"Let me compute. {CALL}", "call_1")
    assert turn == turn.__class__("Let me compute.", [ToolCall("call_1_0", "calculator", {"expression": "123*45"})])
    two = parse(CALL + '<tool_call>{"name": "python", "arguments": {"code": "print(1)"}}</tool_call>', "c")
    assert [(c.id, c.name) for c in two.calls] == [("c_0", "calculator"), ("c_1", "python")] and two.content is None
    listed = parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b"}]</tool_call>', "c")  # SmolLM2's form
    assert [c.name for c in listed.calls] == ["a", "b"] and listed.calls[1].arguments == {}
    plain = parse("The answer is 5535.", "c")
    assert plain.calls == [] and plain.malformed == "" and plain.content == "The answer is 5535."
    assert json.loads(turn.calls[0].openai()["function"]["arguments"]) == {"expression": "123*45"}


@pytest.mark.parametrize("text, reason", [
    ('<tool_call>\n{"name": "calculator", "argum', "ends inside the call (cut by max_new_tokens?)"),
    ('<tool_call>{"name": "f", "arguments": {"x": tru', "ends inside the call (cut by max_new_tokens?)"),
    ('<tool_call>{"name": "f", "arguments": {}}\n</tool_', "ends inside the call (cut by max_new_tokens?)"),
    ('<tool_call>{"name": "f", "arguments": {}} done', "followed by 'done', not </tool_call>"),
    ("<tool_call>{'name': 'calculator'}</tool_call>", "not JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', 'not {"name": string'),
    ('<tool_call>{"name": "f", "arguments": "x=1"}</tool_call>', 'not {"name": string'),
    (f'{CALL}<tool_call>{{"name": "f", "arguments": 3}}</tool_call>', 'not {"name": string'),
    ("<tool_call>[]</tool_call>", "an empty list of calls")])
def test_a_malformed_call_is_the_text_it_is_with_the_reason(text, reason):
    turn = HermesParser().parse(text, "c")
    assert turn.calls == [] and turn.content == text and reason in turn.malformed


def test_a_tag_quoted_in_a_calls_arguments_is_text_and_two_calls_stay_two():
    code = 'print("<tool_call>" if x else "</tool_call>")'
    quoting = f'<tool_call>\n{json.dumps({"name": "python", "arguments": {"code": code}})}\n</tool_call>'
    turn = HermesParser().parse(f"Here: {quoting}", "c")
    assert turn.malformed == "" and turn.content == "Here:" and turn.calls == [ToolCall("c_0", "python", {"code": code})]
    two = HermesParser().parse(quoting + CALL, "c")
    assert two.malformed == "" and [(c.id, c.name) for c in two.calls] == [("c_0", "python"), ("c_1", "calculator")]


@pytest.mark.parametrize("text, says", [
    ('Write "<tool_call>" to call a tool.', "the <tool_call> at character 7: the call is not JSON (Expecting '{' or '['"),
    ('<tool_call>{"name": "python", "arguments": {"code": "s = \'<tool_call>\'"}</tool_call>', "is not JSON")])
def test_an_opening_tag_inside_a_string_is_not_blamed_on_max_new_tokens(text, says):
    turn = HermesParser().parse(text, "c")
    assert turn.calls == [] and says in turn.malformed and "max_new_tokens" not in turn.malformed
    cut = HermesParser().parse('<tool_call>{"name": "python", "arguments": {"code": "s = \'<tool_call>', "c")
    assert cut.malformed == "the <tool_call> at character 0: the text ends inside the call (cut by max_new_tokens?)"


def test_call_tags_that_are_special_tokens_are_kept_by_decoding_and_parsed(tokenizer):
    """Several Hermes-format tokenizers mark <tool_call> and </tool_call> as special tokens."""
    import copy

    special = copy.deepcopy(tokenizer)
    special.add_special_tokens({"additional_special_tokens": ["<tool_call>", "</tool_call>"]},
                               replace_extra_special_tokens=False)
    chat = ChatTemplate(special)
    ep, engine = episode(chat, [CALL, "The answer is 5535."])
    assert special.convert_tokens_to_ids("<tool_call>") in engine.completions[0].token_ids
    assert chat.decode(engine.completions[0].token_ids) == CALL, "the tags kept, the EOS dropped"
    assert ep.info == {"tool_turns": 2, "tool_calls": 1, "malformed_tool_calls": 0} and ep.score == 1.0
    agent = ToolAgent()
    ep, _ = serve(chat, agent, [CALL, "It is 5535."])
    assert agent.finish_reasons == ["tool_calls", "stop"] and ep.score == 1.0


def test_parsers_by_name_or_import_path_and_tool_failures_reach_the_policy_as_errors():
    assert isinstance(tool_parser("hermes", "x"), HermesParser)
    assert isinstance(tool_parser("molt.agents.tools.HermesParser", "x"), HermesParser)
    with pytest.raises(ValueError, match=r"stages.rollout.config.tool_parser: no tool parser 'mistral'; built in"):
        tool_parser("mistral", "stages.rollout.config.tool_parser")
    with pytest.raises(ValueError, match="not a molt.agents.tools.ToolParser subclass"):
        tool_parser("molt.agents.tools.ToolCall", "x")
    tools = {"calculator": Calculator()}
    assert run_tool(tools, ToolCall("c", "calculator", {"expression": "2*3"})) == "6"
    assert run_tool(tools, ToolCall("c", "search", {})) == "error: no tool named 'search'; the tools are ['calculator']"
    assert run_tool(tools, ToolCall("c", "calculator", {})) == "error: KeyError: 'expression'"


def test_the_fallback_defines_tools_in_the_system_message_and_merges_tool_results():
    call = ToolCall("c_0", "calculator", {"expression": "1+1"}).openai()
    out = fallback_messages([{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                             {"role": "tool", "content": "2"}, {"role": "tool", "content": "3"}],
                            [Calculator.schema()], HermesParser())
    assert out[0]["role"] == "system" and '"name": "calculator"' in out[0]["content"]
    assert out[2] == {"role": "assistant", "content": '<tool_call>\n{"name": "calculator", "arguments": '
                                                      '{"expression": "1+1"}}\n</tool_call>'}
    assert out[3] == {"role": "user", "content": "<tool_response>\n2\n</tool_response>\n<tool_response>\n3\n"
                                                 "</tool_response>"} and len(out) == 4


def episode(chat, texts, max_new_tokens=64, max_turns=4):
    engine = ScriptedEngine(chat.tok, texts)
    params = SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens)
    return asyncio.run(run_episode(engine, chat, CalculatorEnv(), TASK, params, "r", max_turns, 1024)), engine


def test_an_env_with_tools_round_trips_through_the_template_token_for_token(chat):
    """SmolLM2's template has no tools: the fallback. The record equals a fresh render of the whole conversation."""
    assert not chat.renders_tools
    ep, engine = episode(chat, [CALL, "The answer is 5535."])
    [seg] = ep.segments
    call_ids, answer_ids = (c.token_ids for c in engine.completions)
    assert ep.score == 1.0 and ep.num_turns == 2 and ep.info == {"tool_turns": 2, "tool_calls": 1, "malformed_tool_calls": 0}
    assert ep.tool_metrics() == {"tool/calls": 1, "tool/malformed_frac": 0.0}
    conversation = [{"role": "user", "content": TASK["question"]},
                    {"role": "assistant", "content": None,
                     "tool_calls": [ToolCall("call_1_0", "calculator", {"expression": "123*45"}).openai()]},
                    {"role": "tool", "content": "5535"}, {"role": "assistant", "content": "The answer is 5535."}]
    fresh = chat.encode(chat.render(conversation, False, [Calculator.schema()]))
    assert seg.token_ids == fresh[:len(seg.token_ids)] and chat.tok.decode(fresh[len(seg.token_ids):]) == "\n"
    generated = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
    assert generated == call_ids + answer_ids, "every generated token is the engine's, trained on"
    result = len(engine.prompts[0]) + len(call_ids), len(engine.prompts[1])  # the tool result's tokens
    assert seg.token_ids[:result[1]] == engine.prompts[1]
    assert not any(seg.loss_mask[result[0]:result[1]]) and "<tool_response>\n5535\n</tool_response>" in \
        chat.tok.decode(seg.token_ids[result[0]:result[1]])
    assert seg.policy_version[result[0]:result[1]] == [-1] * (result[1] - result[0])
    assert '"name": "calculator"' in chat.tok.decode(engine.prompts[0]), "the tools are in the prompt"


def test_a_sampled_call_renders_again_as_it_was_sampled(chat):
    """Non-ASCII and the policy's own spacing: the record still equals a fresh render of its conversation."""
    sampled = '<tool_call>\n{"name": "calculator", "arguments": {"expression":"café"}}\n</tool_call>'
    ep, _ = episode(chat, [sampled, "The answer is 5535."])
    [seg] = ep.segments
    parsed = chat.tool_parser.parse(sampled, "call_1")
    conversation = [{"role": "user", "content": TASK["question"]},
                    {"role": "assistant", "content": parsed.content, "tool_calls": [c.openai() for c in parsed.calls]},
                    {"role": "tool", "content": run_tool({"calculator": Calculator()}, parsed.calls[0])},
                    {"role": "assistant", "content": "The answer is 5535."}]
    fresh = chat.encode(chat.render(conversation, False, [Calculator.schema()]))
    assert seg.token_ids == fresh[:len(seg.token_ids)]
    assert parsed.calls[0].openai()["function"]["arguments"] == '{"expression":"café"}'


def test_a_call_made_in_code_is_written_unescaped_in_the_fallback_and_in_a_demonstration(chat):
    call = ToolCall("call_1_0", "calculator", {"expression": "café"}).openai()
    assert call["function"]["arguments"] == '{"expression": "café"}'
    messages = [{"role": "user", "content": "q"}, {"role": "assistant", "content": None, "tool_calls": [call]},
                {"role": "tool", "content": "error"}, {"role": "assistant", "content": "5535"}]
    written = '<tool_call>\n{"name": "calculator", "arguments": {"expression": "café"}}\n</tool_call>'
    assert fallback_messages(messages, [Calculator.schema()], HermesParser())[2]["content"] == written
    ids, mask = chat.demonstration_ids(messages, [Calculator.schema()])  # an SFT record's tokens
    assert chat.decode([t for t, m in zip(ids, mask) if m]) == written + "5535"


def test_a_template_that_renders_tools_renders_them_itself(tokenizer):
    import copy

    native_tok = copy.deepcopy(tokenizer)
    native_tok.chat_template = NATIVE
    chat = ChatTemplate(native_tok)
    assert chat.renders_tools
    ep, engine = episode(chat, [CALL, "5535"])
    prompt = chat.tok.decode(engine.prompts[0])
    assert prompt.startswith('<|im_start|>system\nYou are helpful.\n<tools>{"type": "function"') and "# Tools" not in prompt
    assert chat.tok.decode(engine.prompts[1]).endswith("<|im_start|>user\n<tool_response>\n5535\n</tool_response>"
                                                       "<|im_end|>\n<|im_start|>assistant\n")
    assert ep.score == 1.0 and len(ep.segments) == 1


def test_an_env_call_cut_by_max_new_tokens_or_malformed_goes_to_the_env_as_text(chat):
    ep, engine = episode(chat, [CALL], max_new_tokens=8)
    assert engine.completions[0].finish_reason == "length" and ep.info["malformed_tool_calls"] == 1
    assert ep.info["malformed_tool_call"].endswith("the text ends inside the call (cut by max_new_tokens?)")
    assert ep.score == 0.0 and ep.num_turns == 1 and ep.completion_text.startswith("<tool_call>")
    ep, _ = episode(chat, [CALL, CALL], max_turns=2)
    assert ep.num_turns == 2 and ep.score == 0.0 and ep.info["tool_calls"] == 2, "a last turn's call is its answer"


def serve(chat, agent, texts, max_new_tokens=128, task=TASK):
    engine = ScriptedEngine(chat.tok, texts)

    async def main():
        server = ChatServer(engine, chat, SamplingParams(temperature=1.0, max_new_tokens=max_new_tokens), 5, 1024)
        try:
            return await server.run_episode(agent, task, "g#0/0")
        finally:
            await server.stop()

    return asyncio.run(main()), engine


def test_the_openai_endpoint_returns_tool_calls_and_takes_tool_results_back_in_one_segment(chat):
    two = CALL + '<tool_call>{"name": "calculator", "arguments": {"expression": "5535+0"}}</tool_call>'
    agent = ToolAgent()
    ep, engine = serve(chat, agent, [two, "It is 5535."])
    assert agent.finish_reasons == ["tool_calls", "stop"] and ep.score == 1.0
    assert ep.info == {"tool_turns": 2, "tool_calls": 2, "malformed_tool_calls": 0}
    [seg] = ep.segments  # the SDK's message objects sent back extend the conversation: no new segment
    generated = [t for t, m in zip(seg.token_ids, seg.loss_mask) if m]
    assert generated == engine.completions[0].token_ids + engine.completions[1].token_ids
    assert "<tool_response>\n5535\n</tool_response>\n<tool_response>\n5535\n</tool_response>" in \
        chat.tok.decode(engine.prompts[1])


@pytest.mark.parametrize("texts, max_new_tokens, finish", [(["<tool_call>{oops}</tool_call>"], 128, "malformed_tool_call"),
                                                           ([CALL], 8, "length")])
def test_the_endpoint_answers_a_malformed_or_cut_call_as_text_saying_so(chat, texts, max_new_tokens, finish):
    agent = ToolAgent()
    ep, engine = serve(chat, agent, texts, max_new_tokens)
    assert agent.finish_reasons == [finish] and ep.info["malformed_tool_calls"] == 1 and ep.score == 0.0
    assert ep.completion_text == chat.decode(engine.completions[0].token_ids)


def test_forcing_a_call_is_refused_since_it_would_change_what_is_sampled(chat):
    from molt.agents import AgentError, ChatAgent

    class Forcing(ChatAgent):
        def run(self, client, task):
            client.chat.completions.create(model="p", messages=[{"role": "user", "content": "x"}],
                                           tools=[Calculator.schema()], tool_choice="required")

    with pytest.raises(AgentError, match="tool_choice 'required' is not supported: forcing a call needs constrained"):
        serve(chat, Forcing(), [CALL])


def test_molt_inspect_shows_a_tool_turn_as_policy_and_context_lines(chat, tmp_path):
    from molt.agents import episode_rows
    from molt.runtime.recording import RecordWriter, summarize
    from molt.schema import COLUMNS, batch_from_rows, make_schema

    ep, _ = episode(chat, [CALL, "The answer is 5535."])
    [row] = episode_rows(ep, "p", "p#0/0", TASK, 1, True)
    schema = make_schema([COLUMNS[c] for c in ("sample_id", "token_ids", "loss_mask", "score")], "trajectory")
    writer = RecordWriter(tmp_path / "rec" / "x.0.arrow")
    writer.write(batch_from_rows([{k: row[k] for k in schema.names}], schema))
    writer.close()
    text = summarize(tmp_path / "rec", chat.tok).split("  text:\n")[1]
    assert '    policy  | <tool_call>\n            | {"name": "calculator", "arguments": {"expression": "123*45"}}\n' \
           '            | </tool_call><|im_end|>\n    context | \n            | <|im_start|>user\n            | <tool_response>\n' \
           '            | 5535\n            | </tool_response><|im_end|>\n            | <|im_start|>assistant\n' \
           '            | \n    policy  | The answer is 5535.<|im_end|>' in text


def test_a_demonstration_is_laid_out_token_for_token_as_the_agents_rollout_of_it(chat):
    """The SFT row of PythonAgent's demonstration equals the record of PythonAgent run on an engine that
    generates exactly the demonstrated turns (through the OpenAI endpoint and the real sandbox)."""
    from molt.agents.python_agent import PythonAgent
    from molt.tasks.configs import ArithmeticTask

    task = ArithmeticTask(style="plain", min_operand=100, max_operand=999, second_operand=(10, 99),
                          operations=("*",)).load().record(0)
    messages, tools = PythonAgent.demonstration(task)
    ids, mask = chat.demonstration_ids(messages, tools)
    turns = [chat.tool_parser.render_calls(messages[-3]["tool_calls"]), messages[-1]["content"]]
    ep, engine = serve(chat, PythonAgent(), turns, task=task)
    [seg] = ep.segments
    assert ep.score == 1.0 and ep.info["tool_calls"] == 1 and ep.completion_text == task["answer"]
    assert seg.token_ids == ids and seg.loss_mask == mask
    assert f"<tool_response>\n{task['answer']}\n\n</tool_response>" in chat.tok.decode(engine.prompts[1]), \
        "the sandbox printed the product"
    with pytest.raises(ValueError, match="no 'A op B' expression"):
        PythonAgent.demonstration({"prompt_id": "x", "messages": [{"role": "user", "content": "hi"}]})
    from stages.sft_records import SFTRecords  # its rows: the same ids and mask, nothing the policy says is context

    stage = SFTRecords.__new__(SFTRecords)
    stage.config = SFTRecords.Config(demonstrations="molt.agents.python_agent.PythonAgent", max_tokens=1024)
    stage.ctx, stage.chat, stage.demonstrate = type("Ctx", (), {"stage_id": "sft"})(), chat, PythonAgent
    row = stage.row("p0", task)
    assert row["token_ids"] == ids and row["loss_mask"] == mask and row["policy_version"] == [-1] * len(ids)


def test_an_agent_is_evaluated_on_its_last_reply_with_its_tool_calls(chat):
    from molt.agents.python_agent import PythonAgent
    from molt.agents.evaluation import EvalTask, evaluate
    from molt.tasks.graders import MathGrader

    problems = [{"messages": [{"role": "user", "content": "What is 12 * 34?"}], "answer": "408"}]
    call = '<tool_call>\n{"name": "python", "arguments": {"code": "print(12 * 34)"}}\n</tool_call>'
    for texts, accuracy in (([call, "408"], 1.0), ([call, call, call, call], 0.0)):  # the last reply is graded
        engine = ScriptedEngine(chat.tok, texts)
        values = asyncio.run(evaluate(engine, chat, problems, MathGrader(), max_new_tokens=64, max_model_len=1024,
                                      agent="molt.agents.python_agent.PythonAgent", max_turns=4, version=0))
        assert values["accuracy"] == accuracy and engine.texts == []
    assert PythonAgent.max_calls + 1 <= EvalTask.model_fields["max_turns"].default
    with pytest.raises(ValueError, match="agent: cannot import module 'molt.agents.nope'"):
        EvalTask.model_validate({"task": {"type": "arithmetic"}, "agent": "molt.agents.nope.Agent"})


class Replying(ChatAgent):
    """One request with ``messages`` (and the calculator), then returns the reply's finish_reason as its reward's
    stand-in: it keeps what it got in ``self.replies``."""

    def __init__(self, *requests):
        self.requests, self.replies = requests, []

    def run(self, client, task):
        for messages in self.requests:
            reply = client.chat.completions.create(model="p", messages=messages, tools=[Calculator.schema()])
            self.replies.append(reply.choices[0])
        return 1.0


def test_a_sent_back_null_or_empty_content_and_tool_results_as_parts_extend_one_segment(chat):
    call = ToolCall("call_1_0", "calculator", {"expression": "123*45"}).openai()
    ask = [{"role": "user", "content": TASK["question"]}]
    agent = Replying(ask, [*ask, {"role": "assistant", "content": "", "tool_calls": [call]},
                           {"role": "tool", "tool_call_id": "call_1_0", "name": "calculator",
                            "content": [{"type": "text", "text": "5535"}]}])
    ep, engine = serve(chat, agent, [CALL, "5535"])
    assert len(ep.segments) == 1 and [c.finish_reason for c in agent.replies] == ["tool_calls", "stop"]
    assert "<tool_response>\n5535\n</tool_response>" in chat.tok.decode(engine.prompts[1])


@pytest.mark.parametrize("message, says", [
    ({"content": "x"}, r"messages\[0\]: a message needs a role"),
    ({"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "f", "arguments": "{}"}}]},
     r"messages\[0\].tool_calls: each is"),
    ({"role": "user", "content": 3}, r"messages\[0\].content: text or a list of parts")])
def test_a_malformed_request_gets_http_400_naming_the_field(chat, message, says):
    from molt.agents import AgentError

    with pytest.raises(AgentError, match="BadRequestError.*" + says):
        serve(chat, Replying([message]), [CALL])


def test_a_tool_result_that_fills_the_context_ends_the_episode_as_length_not_as_a_failure(chat):
    from molt.agents.python_agent import PythonAgent

    huge = '<tool_call>\n{"name": "python", "arguments": {"code": "print(list(range(2000)))"}}\n</tool_call>'
    task = {"messages": [{"role": "user", "content": "What is 12 * 34?"}], "answer": "408"}
    ep, engine = serve(chat, PythonAgent(), [huge], task=task)
    [seg] = ep.segments
    assert ep.score == 0.0 and ep.finish_reason == "length" and ep.num_turns == 2 and len(engine.completions) == 1
    assert len(seg.token_ids) < 1024 and seg.token_ids[-len(engine.completions[0].token_ids):] == \
        engine.completions[0].token_ids, "the record ends with the call: the result did not fit"


def test_the_tool_format_is_a_policy_fact_that_rollout_evaluation_and_sft_records_share():
    from molt.runtime.pipeline import Pipeline

    pipe = Pipeline.from_yaml("pipelines/agent_tools.yaml", ["policy.tool_parser=molt.agents.tools.HermesParser"])
    assert {pipe.stages[s].config.tool_parser for s in ("rollout", "evaluate")} == {"molt.agents.tools.HermesParser"}
    with pytest.raises(ValueError, match=r"stages.evaluate.config.tool_parser is mistral but policy.tool_parser is hermes"):
        Pipeline.from_yaml("pipelines/agent_tools.yaml", ["policy.tool_parser=hermes",
                                                          "stages.evaluate.config.tool_parser=mistral"])
