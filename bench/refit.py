"""Seconds per verified refit of the default model vs moving the same bytes through /dev/shm.

Molt: the trainer side writes the full state dict as safetensors in /dev/shm with a
digest per tensor (``publish_weights``, what the broadcast stage does after the
FSDP2 gather), then the vLLM engine reloads it in place, digesting each tensor as
its loader consumes it, and the digests are verified (``apply_weight_record``).
Baseline, in the same run: ``save_file`` + ``load_file`` of the same tensors through
/dev/shm (the bytes must at least be written and read once). Target: <= 1.5x.
The FSDP2 gather itself is not included (see bench/train.py and the broadcast
stage's ``export_seconds`` metric). Run: ``python bench/refit.py [--repeats 3]``.
"""

from __future__ import annotations

import argparse
import asyncio
import tempfile
import time
from pathlib import Path

import torch


def baseline(state: dict[str, torch.Tensor], folder: Path) -> float:
    """Seconds to write and read back the tensors through /dev/shm."""
    from safetensors.torch import load_file, save_file

    start = time.perf_counter()
    save_file(state, str(folder / "baseline.safetensors"))
    loaded = load_file(str(folder / "baseline.safetensors"))
    assert loaded.keys() == state.keys()
    return time.perf_counter() - start


async def molt_refits(model_dir: Path, state: dict[str, torch.Tensor], folder: Path, repeats: int) -> list[float]:
    """Seconds of each publish + in-place reload + verification on one engine."""
    from molt.engines.vllm import VLLMEngine
    from molt.engines.weights import apply_weight_record, publish_weights

    engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=512, kv_cache_gib=0.5)
    times = []
    try:
        for version in range(1, repeats + 1):
            start = time.perf_counter()
            record = publish_weights(state, folder / f"v{version}.safetensors", version)
            assert await apply_weight_record(engine, record)
            times.append(time.perf_counter() - start)
    finally:
        engine.close()
    return times


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from safetensors.torch import load_file

    from molt.models import resolve_model

    model_dir = resolve_model("smollm2-135m-instruct")
    state = load_file(str(model_dir / "model.safetensors"))  # the names and tensors an export holds
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    base = min(baseline(state, folder) for _ in range(args.repeats))
    ours = min(asyncio.run(molt_refits(model_dir, state, folder, args.repeats)))
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    print(f"{size_mb:.0f} MB: verified refit {ours:.2f} s, /dev/shm write+read {base:.2f} s")
    print(f"ratio refit {ours / base:.2f} (molt {ours:.2f} s / baseline {base:.2f} s)")


if __name__ == "__main__":
    main()
