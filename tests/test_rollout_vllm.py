"""The rollout_only pipeline on the real engine: vLLM (CPU build) and the default model.

One vLLM engine starts inside the rollout stage's process (about 35-45 s here).
"""

import json
import logging

import pytest
import torch

from molt.agents import ChatTemplate
from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import read_batches
from tests.conftest import run_spec

log = logging.getLogger(__name__)
TEMPERATURE = 0.8


def test_rollout_only_on_vllm_is_token_exact_graded_and_matches_trainer_logprobs(
        default_model_dir, tmp_path, no_orphans):
    pytest.importorskip("vllm")
    data = Pipeline.from_yaml("pipelines/rollout_only.yaml").to_dict()
    data["stages"]["source"]["config"]["task"]["num_problems"] = 4
    data["stages"]["rollout"]["config"].update(group_size=2, max_new_tokens=24)
    data["policy"].update(model=str(default_model_dir), temperature=TEMPERATURE)
    code, summary = run_spec(data, tmp_path / "run")
    assert code == 0, summary["error"]
    rows = [r for b in read_batches(tmp_path / "run" / "record" / "reward.out--sink.in") for r in b.to_pylist()]
    assert len(rows) == 8 and all(r["score"] in (0.0, 1.0) for r in rows)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    chat = ChatTemplate(AutoTokenizer.from_pretrained(default_model_dir))
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()
    diffs = []
    for r in rows:
        prompt = chat.prompt_ids(json.loads(r["metadata"])["messages"])
        assert r["token_ids"][:len(prompt)] == prompt, "the prompt is the template rendered once"
        assert r["loss_mask"] == [False] * len(prompt) + [True] * (len(r["token_ids"]) - len(prompt))
        assert set(r["policy_version"][len(prompt):]) == {0}
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([r["token_ids"]])).logits[0, len(prompt) - 1:-1]
        logprobs = torch.log_softmax(logits / TEMPERATURE, -1).gather(
            -1, torch.tensor(r["token_ids"][len(prompt):])[:, None])[:, 0]
        diffs += (logprobs - torch.tensor(r["rollout_logprobs"][len(prompt):])).abs().tolist()
    mean, worst = sum(diffs) / len(diffs), max(diffs)
    log.warning("vLLM fp32 rollout vs transformers fp32: mean |dlogprob| %.2e, max %.2e over %d tokens",
                mean, worst, len(diffs))
    assert mean <= 0.02
