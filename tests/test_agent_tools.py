"""The README's tool-using agent, run short: `pipelines/sft_tools.yaml` (demonstrations of PythonAgent) makes a
model, `pipelines/agent_tools.yaml` trains the agent from it: vLLM rollout through the OpenAI endpoint, python
calls in the sandbox, the agent evaluated on its last reply; the recorded tool turns are token-exact."""

import json

import torch

from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import read_batches
from molt.runtime.runner import Runner
from molt.train.model import load_policy, shard_policy

SMALL_EVAL = ["stages.evaluate.config.task.num_problems=8", "stages.evaluate.config.every_versions=2",
              "stages.evaluate.config.engine.type=transformers"]


def policy_turns(loss_mask):
    """The row's generated spans: a tool turn's row holds at least two (the call, then the answer)."""
    return sum(1 for i, m in enumerate(loss_mask) if m and (i == 0 or not loss_mask[i - 1]))


def run(path, run_dir, overrides):
    code = Runner(Pipeline.from_yaml(path, overrides), run_dir, live=False).run()
    summary = json.loads((run_dir / "summary.json").read_text())
    assert code == 0, summary["error"]
    return summary


def test_the_agent_pipeline_warms_up_on_demonstrations_then_trains_the_agent_on_its_tool_calls(tmp_path, no_orphans):
    model = tmp_path / "python-sft"
    # three steps teach the call format (held-out: 100%); the shipped warm-up stops at two (4-6%: README)
    sft = run("pipelines/sft_tools.yaml", tmp_path / "sft", [
        "stages.source.config.task.num_problems=48", f"stages.train.config.export_model={model}", *SMALL_EVAL])
    assert sft["results"]["steps"] == 3 and (model / "config.json").exists()
    agent = run("pipelines/agent_tools.yaml", tmp_path / "agent", [
        "requires={}", f"policy.model={model}", "stages.source.config.task.num_problems=8",
        "stages.source.config.prompts_per_batch=4", "policy.groups_per_step=4", "stages.rollout.config.group_size=4",
        "stages.rollout.config.max_staleness=0", *SMALL_EVAL])
    assert agent["results"]["steps"] == 2 and agent["results"]["evaluated_version"] == 2
    assert "rollout/tool/calls" in agent["metrics"] and "rollout/tool/malformed_frac" in agent["metrics"]
    rows = [r for b in read_batches(tmp_path / "agent" / "record" / "rollout.out--shape.in") for r in b.to_pylist()]
    tool_turns = [r for r in rows if policy_turns(r["loss_mask"]) > 1]
    assert len(rows) == 32 and tool_turns, "the warmed-up policy calls its tool: call, result, answer"
    # token exactness across tool turns: the trainer's logprobs of the generated tokens are the engine's
    config = Pipeline.from_yaml(tmp_path / "agent" / "pipeline.yaml").stages["train"].config
    policy = shard_policy(load_policy(model, config.temperature), config.compute_dtype)
    on_policy = [r for r in tool_turns if max(r["policy_version"]) == 0][:8]
    with torch.no_grad():
        diffs = torch.cat([(policy(torch.tensor([r["token_ids"]]), torch.arange(len(r["token_ids"]))[None])
                            - torch.tensor(r["rollout_logprobs"]))[torch.tensor(r["loss_mask"])] for r in on_policy])
    assert on_policy and diffs.abs().max() < 1e-4, diffs.abs().max()
