"""Overhead of the Ray placement backend over the local one, on the README's quickstart.

Runs ``molt run pipelines/quickstart.yaml`` in this one invocation with
``placement.backend=local`` (the baseline) and with ``placement.backend=ray`` (a
one-node Ray instance started and stopped by the run), ``--rounds`` times each in
alternating order (local first in even rounds: a fresh checkout's first run also fills
vLLM's and torch's compile caches, measured 161 s against 106 s for the same run
next), and compares the fastest wall-clock times (``summary.json`` ``wall_s``: from the
runner's start to the last process's exit, Ray's start and stop included). All runs are
checked to have trained the same number of steps. Default: the quickstart cut to 2 steps as in
``tests/test_quickstart.py`` (about 2 min per run); ``--full``: the whole 24 steps
(about 18 min per run). Ends with ``ratio placement_ray R (molt ray X s / baseline local Y s)``.

Run: ``python bench/placement.py [--full] [--rounds 2]``.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

SHORT = [  # tests/test_quickstart.py's cut
    "stages.source.config.task.num_problems=8", "stages.source.config.prompts_per_batch=4",
    "stages.source.config.checkpoint_every_batches=1", "stages.rollout.config.group_size=4",
    "policy.groups_per_step=4",
    "stages.evaluate.config.task.num_problems=16", "stages.evaluate.config.every_versions=1",
]


def run(backend: str, overrides: list[str], folder: Path) -> dict:
    run_dir = folder / backend
    sets = [a for o in [*overrides, f"placement.backend={backend}"] for a in ("--set", o)]
    out = subprocess.run([sys.executable, "-m", "molt", "run", "pipelines/quickstart.yaml", "--run-dir",
                          str(run_dir), *sets], capture_output=True, text=True)
    if out.returncode != 0:
        raise SystemExit(f"{backend} run failed:\n{out.stderr[-3000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    print(f"{backend:>5}: wall {summary['wall_s']:.1f} s, steps {summary['results']['steps']:.0f}, "
          f"accuracy {summary['results']['accuracy_baseline']:.3f} -> {summary['results']['accuracy_final']:.3f}")
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole quickstart (24 steps) instead of 2 steps")
    parser.add_argument("--rounds", type=int, default=2, help="runs per backend, in alternating order")
    args = parser.parse_args()
    overrides = [] if args.full else SHORT
    runs: dict[str, list[dict]] = {"local": [], "ray": []}
    with tempfile.TemporaryDirectory(prefix="molt-bench-placement-") as tmp:
        for k in range(args.rounds):
            for backend in ("local", "ray") if k % 2 == 0 else ("ray", "local"):
                runs[backend].append(run(backend, overrides, Path(tmp) / str(k)))
    steps = {s["results"]["steps"] for rs in runs.values() for s in rs}
    if len(steps) != 1:
        raise SystemExit(f"the runs trained different numbers of steps: {sorted(steps)}")
    local, ray = (min(s["wall_s"] for s in runs[b]) for b in ("local", "ray"))
    print(f"ratio placement_ray {ray / local:.2f} (molt ray {ray:.1f} s / baseline local {local:.1f} s, "
          f"fastest of {args.rounds})")

if __name__ == "__main__":
    main()
