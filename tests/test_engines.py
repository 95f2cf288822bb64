"""Engine contract tests: the transformers test double on a tiny random Llama,
and the vLLM engine on the default model (skipped when vLLM or the converted
model is missing; one engine for the whole session, `vllm_session` in conftest.py,
since start-up is ~35 s)."""

from __future__ import annotations

import asyncio
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
import torch

from molt.engines.base import Completion, SamplingParams
from molt.engines.hf import TransformersEngine

logger = logging.getLogger(__name__)

PROMPT = [1, 5, 9, 13, 17]


@pytest.fixture(scope="module")
def tiny_model():
    """A 2-layer random Llama with a 96-token vocabulary (eos = 2)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128, eos_token_id=2, bos_token_id=1,
                         pad_token_id=2, tie_word_embeddings=True)
    return LlamaForCausalLM(config).eval()


def run(coro):
    """Run one coroutine to completion on a fresh event loop."""
    return asyncio.run(coro)


async def sample_n(engine, prompt_id: str, params: SamplingParams, n: int) -> list[Completion]:
    """n concurrent samples of PROMPT with ids prompt_id/0..n-1."""
    return await asyncio.gather(*(engine.generate(f"{prompt_id}/{i}", PROMPT, params)
                                  for i in range(n)))


def recomputed_logprobs(model, prompt: list[int], completion: Completion,
                        temperature: float) -> torch.Tensor:
    """[C] log_softmax(logits / temperature) of a full fp32 forward, at the sampled ids."""
    ids = torch.tensor([prompt + completion.token_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0].float()  # [P + C, V]
    logits = logits[len(prompt) - 1:-1] / temperature  # [C, V]
    logprobs = torch.log_softmax(logits, dim=-1)
    return logprobs.gather(-1, torch.tensor(completion.token_ids)[:, None])[:, 0]


def test_one_seed_gives_n_different_completions_reproducible_across_engines(tiny_model):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, seed=1234)
    first = run(sample_n(TransformersEngine(tiny_model), "q", params, 4))
    again = run(sample_n(TransformersEngine(tiny_model), "q", params, 4))
    assert len({tuple(c.token_ids) for c in first}) == 4
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.logprobs for c in first] == [c.logprobs for c in again]


def test_logprobs_equal_a_recomputed_forward_at_the_sampling_temperature(tiny_model):
    params = SamplingParams(temperature=0.8, max_new_tokens=16, seed=0)
    for completion in run(sample_n(TransformersEngine(tiny_model), "lp", params, 3)):
        expected = recomputed_logprobs(tiny_model, PROMPT, completion, 0.8)
        torch.testing.assert_close(torch.tensor(completion.logprobs), expected,
                                   atol=1e-5, rtol=0)


def test_greedy_decoding_records_untempered_logprobs(tiny_model):
    completion = run(TransformersEngine(tiny_model).generate(
        "g", PROMPT, SamplingParams(temperature=0.0, max_new_tokens=8)))
    expected = recomputed_logprobs(tiny_model, PROMPT, completion, 1.0)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=1e-5, rtol=0)


def test_max_new_tokens_ends_with_length_and_a_stop_id_ends_with_stop(tiny_model):
    engine = TransformersEngine(tiny_model)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=10)
    full = run(engine.generate("a", PROMPT, greedy))
    assert len(full.token_ids) <= 10
    assert full.finish_reason == ("stop" if full.token_ids[-1] == 2 else "length")
    stop_id = full.token_ids[3]
    first_stop = full.token_ids.index(stop_id)
    stopped = run(engine.generate("b", PROMPT, SamplingParams(
        temperature=0.0, max_new_tokens=10, stop_token_ids=[stop_id])))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == full.token_ids[:first_stop + 1]


def test_renormalising_sampling_settings_are_refused():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.9)
    with pytest.raises(ValueError, match="top_k"):
        SamplingParams(top_k=20)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1.0)


def test_tokens_after_a_weight_load_carry_the_new_version(tiny_model, tmp_path):
    import copy

    from safetensors.torch import save_file

    model = copy.deepcopy(tiny_model)
    state = {k: v.clone() for k, v in model.state_dict().items() if k != "lm_head.weight"}
    path = str(tmp_path / "w.safetensors")
    save_file(state, path)
    engine = TransformersEngine(model)
    params = SamplingParams(temperature=1.0, max_new_tokens=40, seed=3,
                            stop_token_ids=())

    async def scenario() -> Completion:
        task = asyncio.create_task(engine.generate("v", PROMPT, params))
        while "v" not in engine._requests or not engine._requests["v"].completion.token_ids:
            await asyncio.sleep(0.001)
        await engine.pause()
        num_before = len(engine._requests["v"].completion.token_ids)
        await engine.load_weights(path, version=7)
        assert len(engine._requests["v"].completion.token_ids) == num_before
        await engine.resume()
        return num_before, await task

    num_before, completion = run(scenario())
    assert engine.policy_version == 7
    versions = completion.policy_versions
    assert 0 < num_before < len(versions)
    assert versions == [0] * num_before + [7] * (len(versions) - num_before)
    assert set(engine.last_weight_digests) == set(state)


def test_vllm_only_keys_given_to_the_transformers_engine_are_named_in_a_warning(tiny_chat_model, caplog):
    from molt.engines import EngineConfig, make_engine

    config = EngineConfig.model_validate({"type": "transformers", "kv_cache_gib": 0.5, "block_size": 32})
    with caplog.at_level(logging.WARNING, logger="molt.engines.config"):
        make_engine(config, str(tiny_chat_model), "stages.rollout.config.engine").close()
    assert "stages.rollout.config.engine: block_size, kv_cache_gib set but ignored by the transformers engine" \
        in caplog.text
    caplog.clear()
    round_trip = EngineConfig.model_validate(EngineConfig(type="transformers").model_dump())  # as a stage gets it
    make_engine(round_trip, str(tiny_chat_model)).close()
    assert "ignored" not in caplog.text


def test_abort_ends_a_request_with_abort(tiny_model):
    engine = TransformersEngine(tiny_model)

    async def scenario() -> Completion:
        await engine.pause()
        task = asyncio.create_task(engine.generate("x", PROMPT, SamplingParams(max_new_tokens=50)))
        await asyncio.sleep(0.01)
        await engine.abort("x")
        await engine.resume()
        return await task

    completion = run(scenario())
    assert completion.finish_reason == "abort" and completion.token_ids == []


# ---------------------------------------------------------------- vLLM engine

COUNT_PROMPT = "Count from 1 to 200, separated by commas."
QUESTION = "What is 12 + 30? Answer with just the number."


def chat_ids(tokenizer, text: str) -> list[int]:
    """Token ids of a one-turn chat prompt with the generation prompt appended."""
    ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                        add_generation_prompt=True, tokenize=True)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


@pytest.fixture(scope="session")
def hf_reference(vllm_session):
    """The default model in fp32 through transformers, the trainer's view."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(vllm_session[3], dtype=torch.float32).eval()


def test_vllm_is_token_in_token_out_with_stop_and_length(vllm_session):
    loop, engine, tokenizer, _ = vllm_session
    prompt = chat_ids(tokenizer, QUESTION)
    done = loop.run_until_complete(engine.generate(
        "tt-stop", prompt, SamplingParams(temperature=0.0, max_new_tokens=64)))
    assert done.finish_reason == "stop" and done.token_ids[-1] == tokenizer.eos_token_id
    assert all(isinstance(t, int) for t in done.token_ids)
    assert done.policy_versions == [0] * len(done.token_ids)
    cut = loop.run_until_complete(engine.generate(
        "tt-len", prompt, SamplingParams(temperature=0.0, max_new_tokens=3)))
    assert cut.finish_reason == "length" and cut.token_ids == done.token_ids[:3]
    stop_id = done.token_ids[1]
    stopped = loop.run_until_complete(engine.generate(
        "tt-id", prompt, SamplingParams(temperature=0.0, max_new_tokens=64,
                                        stop_token_ids=[stop_id])))
    assert stopped.finish_reason == "stop"
    assert stopped.token_ids == done.token_ids[:done.token_ids.index(stop_id) + 1]


def test_vllm_fp32_logprobs_match_a_transformers_fp32_forward(vllm_session, hf_reference):
    loop, engine, tokenizer, _ = vllm_session
    prompts = [chat_ids(tokenizer, f"What is {a} + {b}?") for a, b in
               [(12, 30), (45, 17), (23, 58), (31, 44), (10, 99), (60, 25), (77, 11), (38, 38)]]
    params = SamplingParams(temperature=0.8, max_new_tokens=24)

    async def sample() -> list[Completion]:
        return await asyncio.gather(*(engine.generate(f"lp-{i}-{j}", p, params)
                                      for i, p in enumerate(prompts) for j in range(2)))

    start = time.perf_counter()
    completions = loop.run_until_complete(sample())
    seconds = time.perf_counter() - start
    deltas = torch.cat([
        (torch.tensor(c.logprobs) - recomputed_logprobs(hf_reference, p, c, 0.8)).abs()
        for c, p in zip(completions, [p for p in prompts for _ in range(2)])])
    num_tokens = sum(len(c.token_ids) for c in completions)
    logger.warning("vLLM fp32 vs transformers fp32 at T=0.8: mean |dlogprob| %.2e, max %.2e "
                   "over %d tokens; 16 requests in %.1f s (%.0f tok/s)", deltas.mean(),
                   deltas.max(), deltas.numel(), seconds, num_tokens / seconds)
    assert deltas.mean() < 1e-3 and deltas.max() < 2e-2


def test_vllm_load_weights_changes_output_versions_tokens_and_restores_exactly(
        vllm_session, hf_reference, tmp_path):
    from safetensors.torch import load_file, save_file

    loop, engine, tokenizer, folder = vllm_session
    shm = tmp_path if not os.path.isdir("/dev/shm") else Path(tempfile.mkdtemp(dir="/dev/shm"))
    original = load_file(str(folder / "model.safetensors"))
    zeroed = {k: torch.zeros_like(v) if "down_proj" in k else v for k, v in original.items()}
    original_path, zeroed_path = str(shm / "original.safetensors"), str(shm / "zeroed.safetensors")
    save_file(original, original_path)
    save_file(zeroed, zeroed_path)
    prompt = chat_ids(tokenizer, QUESTION)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    base = engine.policy_version

    async def scenario():
        before = await engine.generate("w-before", prompt, greedy)
        # A long request stays in flight across the load, so the prefix cache cannot be
        # cleared: the version salt alone must keep "w-zeroed" off the cached prompt.
        long_task = asyncio.create_task(engine.generate(
            "w-long", chat_ids(tokenizer, COUNT_PROMPT),
            SamplingParams(temperature=0.3, max_new_tokens=160)))
        await asyncio.sleep(2.0)
        await engine.load_weights(zeroed_path, version=base + 1)
        zeroed_digests = dict(engine.last_weight_digests)
        during = await engine.generate("w-zeroed", prompt, greedy)
        long_completion = await long_task
        await engine.load_weights(original_path, version=base + 2)
        after = await engine.generate("w-after", prompt, greedy)
        return before, during, long_completion, after, zeroed_digests

    try:
        before, during, long_completion, after, zeroed_digests = loop.run_until_complete(scenario())
    finally:
        shutil.rmtree(shm, ignore_errors=True)
    logger.warning("vLLM reload of %d tensors: %.2f s", len(original), engine.last_load_seconds)
    assert zeroed_digests == file_digests_of(zeroed)
    assert engine.last_weight_digests == file_digests_of(original)
    assert during.token_ids != before.token_ids
    assert during.policy_versions == [base + 1] * len(during.token_ids)
    # The zeroed model's logprobs, recomputed from scratch: a stale cached prompt would differ.
    hf_zeroed = copy_with(hf_reference, zeroed)
    torch.testing.assert_close(torch.tensor(during.logprobs),
                               recomputed_logprobs(hf_zeroed, prompt, during, 1.0),
                               atol=2e-3, rtol=0)
    assert after.token_ids == before.token_ids and after.logprobs == before.logprobs
    assert after.policy_versions == [base + 2] * len(after.token_ids)
    versions = long_completion.policy_versions
    assert versions == sorted(versions) and versions[0] == base and versions[-1] == base + 1, \
        f"the long request should straddle the load; got versions {versions}"


def file_digests_of(state: dict[str, torch.Tensor]) -> dict[str, str]:
    """name -> tensor_digest for an in-memory state dict."""
    from molt.refit import tensor_digest

    return {name: tensor_digest(t) for name, t in state.items()}


def copy_with(model, state: dict[str, torch.Tensor]):
    """A deep copy of `model` with `state` loaded (tied weights kept tied)."""
    import copy

    clone = copy.deepcopy(model)
    clone.load_state_dict(state, strict=False)
    return clone


def test_vllm_engine_survives_a_seeded_request_at_positive_temperature(vllm_session, caplog):
    loop, engine, tokenizer, _ = vllm_session
    prompt = chat_ids(tokenizer, QUESTION)
    engine._warned_seed = False
    with caplog.at_level(logging.WARNING, logger="molt.engines.vllm"):
        seeded = loop.run_until_complete(engine.generate(
            "seed-1", prompt, SamplingParams(temperature=1.0, max_new_tokens=8, seed=123)))
    assert "ignores per-request seeds" in caplog.text
    assert seeded.token_ids
    later = loop.run_until_complete(engine.generate(
        "seed-2", prompt, SamplingParams(temperature=1.0, max_new_tokens=8)))
    assert later.token_ids and later.finish_reason in ("stop", "length")


def test_vllm_abort_ends_a_request_with_abort(vllm_session):
    loop, engine, tokenizer, _ = vllm_session

    async def scenario() -> Completion:
        task = asyncio.create_task(engine.generate(
            "abort-1", chat_ids(tokenizer, COUNT_PROMPT),
            SamplingParams(temperature=0.3, max_new_tokens=400)))
        await asyncio.sleep(1.0)
        await engine.abort("abort-1")
        return await task

    completion = loop.run_until_complete(scenario())
    assert completion.finish_reason == "abort"
    assert len(completion.token_ids) < 400


def test_the_engine_seed_samples_requests_that_bring_none_and_a_request_seed_wins(tiny_model):
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    first = run(sample_n(TransformersEngine(tiny_model, seed=5), "q", params, 4))
    again = run(sample_n(TransformersEngine(tiny_model, seed=5), "q", params, 4))
    other = run(sample_n(TransformersEngine(tiny_model, seed=6), "q", params, 4))
    assert [c.token_ids for c in first] == [c.token_ids for c in again]
    assert [c.token_ids for c in first] != [c.token_ids for c in other]
    seeded = SamplingParams(temperature=1.0, max_new_tokens=12, seed=5)
    assert [c.token_ids for c in run(sample_n(TransformersEngine(tiny_model, seed=6), "q", seeded, 4))] == \
        [c.token_ids for c in first]


@pytest.mark.parametrize("how", ["killed", "failed"])
def test_a_dead_vllm_engine_core_is_reported_with_its_signal_or_exit_code(how):
    """vLLM's own message points at a stack trace that a killed engine core never wrote."""
    import multiprocessing
    import signal
    import sys
    from types import SimpleNamespace

    pytest.importorskip("vllm")
    from vllm.v1.engine.exceptions import EngineDeadError as VLLMEngineDead

    from molt.engines.base import Engine, EngineDeadError
    from molt.engines.vllm import VLLMEngine

    core = multiprocessing.get_context("fork").Process(target=time.sleep if how == "killed" else sys.exit,
                                                       args=(60 if how == "killed" else 3,))
    core.start()
    if how == "killed":
        os.kill(core.pid, signal.SIGKILL)
    engine = VLLMEngine.__new__(VLLMEngine)  # an engine whose core process is `core`
    Engine.__init__(engine)
    engine.dead_errors = (EngineDeadError, VLLMEngineDead)
    manager = SimpleNamespace(processes=[core])
    engine._llm = SimpleNamespace(engine_core=SimpleNamespace(resources=SimpleNamespace(engine_manager=manager)))
    vllm_says = "EngineCore encountered an issue. See stack trace (above) for the root cause."

    async def request():
        raise VLLMEngineDead()

    with pytest.raises(EngineDeadError) as dead:
        run(engine.tracked("request 'r0'", request))
    status = "was killed by signal SIGKILL" if how == "killed" else f"exited with code 3; vLLM: {vllm_says}"
    assert str(dead.value) == f"request 'r0': the engine died: vLLM's engine core (pid {core.pid}) {status}"
