"""Asynchronous versus synchronous Molt on the quickstart task, same machine, same run.

Runs ``pipelines/quickstart.yaml`` without its evaluation stages (as ``bench/vs_trl.py``
does, same prompts in order) for ``--steps`` steps four times:

- ``async``: the quickstart's placement: ``max_staleness: 1``, vLLM pinned to core 0,
  the trainer to core 1, so generation of step k+1 overlaps training of step k.
- ``async_shared``: ``max_staleness: 1`` with both stages on both cores (``cpus: 0-1``):
  they overlap and compete for the same cores.
- ``sync_pinned``: ``max_staleness: 0`` with the quickstart's placement: on-policy, each
  core idles while the other stage works.
- ``sync_shared``: ``max_staleness: 0`` with both stages on both cores: on-policy,
  generation and training each get the whole machine in turn.

Per run it prints the steady-state seconds per step (last step end minus first step end
over the steps between), generated tokens/s, the rewards per step and the mean token
staleness. Run: ``python bench/async_gain.py [--steps 6]``. Ends with
``ratio async_gain R (molt X steps/min / baseline Y steps/min)``: the faster async run
versus the faster sync run (> 1 = asynchrony pays).
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from vs_trl import molt_side

SYNC = ("policy.max_staleness=0",)
SHARED = ("stages.rollout.cpus=0-1", "stages.train.cpus=0-1")
RUNS = {"async": (), "async_shared": SHARED, "sync_pinned": SYNC, "sync_shared": (*SYNC, *SHARED)}


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
    fastest = {kind: min((n for n in results if n.startswith(kind)), key=lambda n: results[n]["s_per_step"])
               for kind in ("async", "sync")}
    a, s = (60 / results[fastest[kind]]["s_per_step"] for kind in ("async", "sync"))
    print(f"ratio async_gain {a / s:.2f} (molt {a:.3f} steps/min / baseline {s:.3f} steps/min; "
          f"{fastest['async']} vs {fastest['sync']})")


if __name__ == "__main__":
    main()
