"""Mixture-of-experts policies: the upcycled MoE (molt.models.upcycle) on CPU."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from molt.cli import main
from tests.test_engines import chat_ids as chat

PROMPTS = ("What is 23 + 41? Answer with just the number.", "Name three colours.", "Count from 1 to 5.")


@pytest.fixture(scope="module")
def upcycled(default_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The default model upcycled to 4 experts, top-2, through the CLI."""
    out = tmp_path_factory.mktemp("moe") / "smollm2-moe-e4k2"
    assert main(["models", "upcycle", "smollm2-135m-instruct", str(out), "--experts", "4", "--top-k", "2"]) == 0
    return out


def test_the_upcycled_moe_computes_the_dense_models_logits(upcycled, default_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    dense = AutoModelForCausalLM.from_pretrained(default_model_dir)
    moe = AutoModelForCausalLM.from_pretrained(upcycled)
    assert type(moe).__name__ == "MixtralForCausalLM" and moe.dtype == torch.float32
    assert json.loads((upcycled / "molt-model.json").read_text())["num_experts"] == 4
    tokenizer = AutoTokenizer.from_pretrained(upcycled)  # the chat template came along
    ids = torch.tensor([chat(tokenizer, PROMPTS[0]) + chat(tokenizer, PROMPTS[1])])
    with torch.no_grad():
        diff = (dense(ids).logits - moe(ids).logits).abs().max().item()
    assert diff < 1e-3, diff  # measured 7e-5
    layer = moe.model.layers[0].mlp
    experts = layer.experts.gate_up_proj
    assert all(torch.equal(experts[0], experts[e]) for e in range(1, 4))
    assert not torch.equal(layer.gate.weight, moe.model.layers[1].mlp.gate.weight)  # fresh, seeded routers
    with torch.no_grad():  # the router does pick different experts for different tokens
        top = layer.gate(moe.model.embed_tokens(ids)[0])[2]
    assert len(set(top[:, 0].tolist())) > 1


def test_upcycle_refuses_what_it_cannot_convert(upcycled, tiny_chat_model, tmp_path):
    from molt.models.upcycle import upcycle

    with pytest.raises(ValueError, match="output folder exists"):
        upcycle(tiny_chat_model, upcycled)
    with pytest.raises(ValueError, match="experts >= 2"):
        upcycle(tiny_chat_model, tmp_path / "a", num_experts=4, top_k=5)
    with pytest.raises(ValueError, match="architectures must be"):
        upcycle(upcycled, tmp_path / "b")  # already a MoE
    biased = tmp_path / "biased"
    shutil.copytree(tiny_chat_model, biased)
    config = json.loads((biased / "config.json").read_text())
    (biased / "config.json").write_text(json.dumps({**config, "attention_bias": True}))
    with pytest.raises(ValueError, match=r"config.json: attention_bias is true"):
        upcycle(biased, tmp_path / "c")
    assert not any(p.name.startswith((".a", ".b", ".c")) for p in tmp_path.iterdir())  # nothing half-written


def test_vllm_serves_the_upcycled_moe_with_the_dense_models_greedy_output(vllm_session, upcycled):
    from molt.engines.base import SamplingParams
    from molt.engines.vllm import VLLMEngine

    loop, dense, tokenizer, _ = vllm_session
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)

    async def both() -> tuple[list, list]:
        moe = VLLMEngine(str(upcycled), dtype="float32", max_model_len=512, kv_cache_gib=0.5)
        try:
            ids = [chat(tokenizer, p) for p in PROMPTS]
            return ([(await dense.generate(f"d{i}", x, greedy)).token_ids for i, x in enumerate(ids)],
                    [(await moe.generate(f"m{i}", x, greedy)).token_ids for i, x in enumerate(ids)])
        finally:
            moe.close()

    dense_out, moe_out = loop.run_until_complete(both())
    assert moe_out == dense_out and all(dense_out)
