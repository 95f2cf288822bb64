"""`molt export`: a run's policy at a version as a Hugging Face folder that transformers loads."""

import json
import os

import torch
from transformers import AutoModelForCausalLM

from click.testing import CliRunner

from molt.commands import main
from molt.runtime.recording import read_batches


def logprob_gaps(model_dir, rows, version):
    """|log p_model(token) - the engine's logprob| of every generated token of ``version`` in ``rows``."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gaps = []
    for r in rows:
        ids = torch.tensor([r["token_ids"]])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
        gaps += [abs(float(logp[i - 1]) - r["rollout_logprobs"][i]) for i in range(1, len(r["token_ids"]))
                 if r["loss_mask"][i] and r["policy_version"][i] == version]
    return gaps


def molt(*args):
    """``molt ARGS`` in this process: the result's exit_code, stdout and stderr."""
    return CliRunner().invoke(main, [str(a) for a in args])


def test_an_exported_version_is_the_policy_that_sampled_that_versions_tokens(full_rl_run, tiny_chat_model, tmp_path):
    done = molt("export", full_rl_run, tmp_path / "v2", "--version", "2")
    assert done.exit_code == 0 and "policy version 2" in done.stdout, done.output
    files = {f.name for f in (tmp_path / "v2").iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "molt_export.json"} <= files
    assert not {"optimizer.pt", "rng.rank0.pt", "molt-model.json"} & files, "the training state stays behind"
    umask = os.umask(0o22)
    os.umask(umask)
    assert {f.stat().st_mode & 0o777 for f in (tmp_path / "v2").iterdir()} == {0o666 & ~umask}, "as the umask allows"
    made = json.loads((tmp_path / "v2" / "molt_export.json").read_text())
    assert made["policy_version"] == 2 and made["started_from"] == str(tiny_chat_model)
    rows = [r for b in read_batches(full_rl_run / "record" / "rollout.out--reward.in") for r in b.to_pylist()]
    gaps = logprob_gaps(tmp_path / "v2", rows, 2)
    assert len(gaps) >= 8 and max(gaps) < 1e-4, "the engine sampled version 2's tokens from these weights"
    assert molt("export", full_rl_run, tmp_path / "newest").exit_code == 0
    assert json.loads((tmp_path / "newest" / "molt_export.json").read_text())["policy_version"] == 4
    assert max(logprob_gaps(tmp_path / "newest", rows, 2)) > 1e-3, "another version's weights do not match"


def test_export_refuses_what_it_cannot_write_naming_it(full_rl_run, tmp_path):
    done = molt("export", full_rl_run, tmp_path / "x", "--version", "99")
    assert done.exit_code == 2 and "no complete checkpoint at step 99" in done.stderr
    done = molt("export", tmp_path, tmp_path / "x")
    assert done.exit_code == 2 and "not a run directory" in done.stderr
    (tmp_path / "x").mkdir()
    done = molt("export", full_rl_run, tmp_path / "x")
    assert done.exit_code == 2 and "exists" in done.stderr
    assert not list(tmp_path.glob(".x.partial-*")), "nothing half-written is left"
