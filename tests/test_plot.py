"""`molt plot`: the figures a run's metrics allow, as PNG files."""

import json

from click.testing import CliRunner

from molt.commands import main


def write_metrics(run_dir, entries):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for stage, step, values in entries:
            f.write(json.dumps({"time": 0.0, "stage": stage, "replica": 0, "step": step, "values": values}) + "\n")


def test_plot_writes_one_png_per_figure_the_metrics_allow(tmp_path):
    entries = [("train", k, {"train/reward/mean": 0.1 * k, "train/lag/max": k % 2, "train/step_seconds": 2.0,
                             "train/logprob_diff/abs_mean": 1e-5, "train/logprob_diff/abs_max": 1e-4,
                             "train/moe/expert_share/e0": 0.6, "train/moe/expert_share/e1": 0.4,
                             "train/moe/load_max": 1.2 + 0.1 * k, "train/entropy/mean": 0.5 / (k + 1),
                             "train/collapse/identical_groups_frac": 0.2 * k})
               for k in range(4)]
    entries += [("evaluate", v, {"evaluate/accuracy": 0.2 + 0.1 * v, "evaluate/accuracy_stderr": 0.02})
                for v in (0, 2, 4)]
    entries.append(("rollout", None, {"rollout/refit_seconds": 0.9}))
    write_metrics(tmp_path / "run", entries)
    out = CliRunner().invoke(main, ["plot", str(tmp_path / "run")])
    assert out.exit_code == 0, out.output
    names = sorted(p.name for p in (tmp_path / "run" / "plots").iterdir())
    assert names == ["collapse.png", "eval.png", "expert_load.png", "logprob_diff.png", "reward.png", "staleness.png",
                     "time.png"]
    assert all((tmp_path / "run" / "plots" / n).read_bytes()[:4] == b"\x89PNG" for n in names)


def test_plot_skips_figures_without_metrics_and_refuses_a_non_run(tmp_path):
    write_metrics(tmp_path / "run", [("train", 0, {"train/reward/mean": 0.5})])
    out = CliRunner().invoke(main, ["plot", str(tmp_path / "run")])
    assert out.exit_code == 0 and out.stdout.strip().endswith("reward.png")
    out = CliRunner().invoke(main, ["plot", str(tmp_path)])
    assert out.exit_code == 2 and "no such file; hint: molt plot takes a run directory" in out.stderr
