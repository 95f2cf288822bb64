"""Asynchronous versus synchronous Molt on the quickstart task, same machine, same run.

Runs ``pipelines/quickstart.yaml`` without its evaluation stages (as ``bench/vs_trl.py``
does, same prompts in order) for ``--steps`` steps three times:

- ``async``: the quickstart as shipped: ``max_staleness: 1``, vLLM pinned to core 0,
  the trainer to core 1, so generation of step k+1 overlaps training of step k.
- ``sync_pinned``: ``max_staleness: 0`` with the same placement: on-policy, each core
  idles while the other stage works.
- ``sync_shared``: ``max_staleness: 0`` with both stages on both cores (``cpus: 0-1``):
  on-policy, generation and training each get the whole machine in turn.

Per run it prints the steady-state seconds per step (last step end minus first step end
over the steps between), generated tokens/s, the rewards per step and the mean token
staleness; then one ratio per sync run (sync s/step over async s/step; > 1 = async is
faster). Run: ``python bench/async_gain.py [--steps 6]``. Ends with
``ratio async_gain R (molt X steps/min / baseline Y steps/min)`` (async vs the faster sync).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from vs_trl import molt_side

SYNC = ("stages.rollout.config.max_staleness=0", "stages.train.config.max_staleness=0")
RUNS = {"async": (),
        "sync_pinned": SYNC,
        "sync_shared": (*SYNC, "stages.rollout.cpus=0-1", "stages.train.cpus=0-1")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per run (>= 4)")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error("--steps must be >= 4")
    results = {}
    with tempfile.TemporaryDirectory(prefix="molt-async-") as tmp:
        for name, overrides in RUNS.items():
            r = results[name] = molt_side(args.steps, Path(tmp), overrides)
            print(f"{name:12s} {r['s_per_step']:6.1f} s/step  {r['tokens_per_s']:6.1f} generated tok/s  "
                  f"staleness {r['mean_staleness']:.2f}  wall {r['wall_s']:.0f} s  "
                  f"rewards {[round(x, 3) for x in r['rewards']]}", flush=True)
    for name in ("sync_pinned", "sync_shared"):
        print(f"{name} / async: {results[name]['s_per_step'] / results['async']['s_per_step']:.2f} x the time per step")
    best = min(("sync_pinned", "sync_shared"), key=lambda n: results[n]["s_per_step"])
    a, s = 60 / results["async"]["s_per_step"], 60 / results[best]["s_per_step"]
    print(f"ratio async_gain {a / s:.2f} (molt {a:.3f} steps/min / baseline {s:.3f} steps/min, {best})")


if __name__ == "__main__":
    main()
