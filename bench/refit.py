"""Seconds per verified refit of the default model vs moving the same bytes through /dev/shm.

Molt, per version, what the trainer (molt.train.publish) and the rollout do after the FSDP2 gather:
the atomic safetensors write to /dev/shm on a thread, beside it a digest per tensor
computed from memory and the trainer's probe forward (molt.refit, FSDP2 at
world size 1; ``publish_weights``), then ``apply_weight_record`` on a
vLLM engine: the in-place reload that digests each tensor as the loader consumes it,
the digest comparison, the engine's probe logprobs and the probe checks. Every
version changes every weight a little (as an optimizer step does), so the probe's
"must change" check runs. Not included: the gather (printed beside) and the
engine's probe before the first refit (later refits reuse the previous one).

Baseline, in the same run: ``save_file`` of the same tensors to /dev/shm, then
``load_file`` and a copy of every tensor (``load_file`` only maps the file; a
refit must read every byte at least once; a read that only touches the mapped bytes,
without copying them anywhere, is printed beside). Target: <= 1.5x. The two alternate
``--repeats`` times and each keeps its best (a shared 2-core machine is noisy: single
refits here vary up to 4-5x; every repeat and the medians are printed beside).
Run: ``python bench/refit.py [--repeats 10]``; ends with
``ratio refit R (molt X s / baseline Y s)`` after a breakdown of the best refit.

``--lora``: a LoRA policy (rank 16, alpha 32 on every linear of attention and MLP, as
pipelines/quickstart_lora.yaml) refitted three ways, alternating per version: its adapter alone
(``publish_adapter``) served by a vLLM engine with LoRA (molt.engines.vllm_lora) or merged into its
weights by an engine without (the CPU default), against its merged weights (``publish_weights`` of
``full_state_dict``), each from the trainer's gather to the verified refit. Ends with
``lora refit: bytes Bx fewer, Sx faster served, Mx faster merged by the engine``.
Targets (issue 32): >= 10x fewer bytes, >= 3x faster.
"""

from __future__ import annotations

import argparse
import asyncio
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch


def baseline(state: dict[str, torch.Tensor], folder: Path) -> tuple[float, float, float]:
    """Seconds to write the tensors to /dev/shm, to map and copy them back, and (for the
    record, not counted) to map them and only touch every byte (a sum, no allocation)."""
    from safetensors.torch import load_file, save_file

    start = time.perf_counter()
    save_file(state, str(folder / "baseline.safetensors"))
    written = time.perf_counter()
    loaded = {name: t.clone() for name, t in load_file(str(folder / "baseline.safetensors")).items()}
    assert loaded.keys() == state.keys()
    read = time.perf_counter()
    for tensor in load_file(str(folder / "baseline.safetensors")).values():
        tensor.sum()
    return written - start, read - written, time.perf_counter() - read


def step_like_change(model: torch.nn.Module, version: int) -> None:
    """Change every weight slightly, in place, as an optimizer step would."""
    with torch.no_grad():
        for param in model.parameters():
            param.mul_(1.0 + 1e-4 * (-1) ** version)


async def alternate(model_dir: Path, folder: Path,
                    repeats: int) -> tuple[list[dict[str, float]], list[tuple[float, float, float]]]:
    """Per repeat, one verified refit and one baseline (alternating, so both see the same load)."""
    from molt.engines.refit import apply_weight_record
    from molt.engines.vllm import VLLMEngine
    from molt.refit import probe_token_ids
    from molt.train import full_state_dict, load_policy, shard_policy
    from molt.train.publish import policy_probe, publish_weights

    model = shard_policy(load_policy(model_dir, temperature=1.0))
    probe_ids = probe_token_ids(model.lm.config.vocab_size)
    engine = VLLMEngine(str(model_dir), dtype="float32", max_model_len=512, kv_cache_gib=0.5)
    engine.last_probe = (probe_ids, await engine.prompt_logprobs(probe_ids))  # as after a previous refit
    rows, bases = [], []
    try:
        for version in range(1, repeats + 1):
            step_like_change(model, version)
            start = time.perf_counter()
            state = full_state_dict(model)
            gathered = time.perf_counter()
            probed: list[float] = []

            def probe():  # as the trainer publishes: the probe's forward overlaps the write
                out = policy_probe(model, probe_ids, atol=1e-3)
                probed.append(time.perf_counter())
                return out

            record = publish_weights(state, folder / f"v{version}.safetensors", version, probe)
            published = time.perf_counter()
            assert await apply_weight_record(engine, record)
            done = time.perf_counter()
            diff = max(abs(a - b) for a, b in zip(engine.last_probe[1], record["probe_logprobs"]))  # type: ignore[index]
            rows.append({"gather": gathered - start, "trainer_probe": probed[0] - gathered,
                         "publish": published - gathered, "apply": done - published,
                         "engine_load": engine.last_load_seconds, "probe_max_diff": diff,
                         "total": done - gathered})
            (folder / f"v{version}.safetensors").unlink()
            bases.append(baseline(state, folder))
    finally:
        engine.close()
    return rows, bases


KINDS = ("lora", "lora_merged", "full")  # a refit of the adapter served, of the adapter merged by the engine, merged


async def lora_against_full(model_dir: Path, folder: Path, repeats: int) -> dict[str, list[float]]:
    """Per version, a verified adapter refit and a verified merged refit of one LoRA policy (module
    docstring): seconds from the gather to the verified refit and bytes published, for each."""
    from molt.engines.refit import apply_weight_record
    from molt.engines.vllm import VLLMEngine
    from molt.policy import LoraConfig
    from molt.refit import probe_token_ids
    from molt.train import full_state_dict, load_policy, shard_policy
    from molt.train.lora import adapter_state
    from molt.train.publish import policy_probe, publish_adapter, publish_weights

    lora = LoraConfig(rank=16, alpha=32)
    model = load_policy(model_dir, temperature=1.0)
    model.add_lora(lora)
    model = shard_policy(model)
    with torch.no_grad():  # B starts at 0: make every adapter count, so each version changes the probe
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 1e-3)
    probe_ids = probe_token_ids(model.lm.config.vocab_size)
    engines = {kind: VLLMEngine(str(model_dir), dtype="float32", max_model_len=512, kv_cache_gib=0.5,
                                lora=lora if kind == "lora" else None, max_loras=2) for kind in KINDS}
    out: dict[str, list[float]] = {f"{kind}{part}": [] for kind in KINDS for part in ("", "_publish", "_load", "_bytes")}
    try:
        for version in range(1, repeats + 1):
            with torch.no_grad():
                for name, param in model.named_parameters():
                    if ".lora_" in name:
                        param.mul_(1.0 + 1e-2 * (-1) ** version)
            for kind, engine in engines.items():
                start = time.perf_counter()
                probe = lambda: policy_probe(model, probe_ids, atol=1e-3)  # noqa: E731
                if kind != "full":  # the adapter alone, served ("lora") or merged by the engine ("lora_merged")
                    record = publish_adapter(adapter_state(model), folder / f"{kind}{version}", version, probe, lora)
                else:
                    record = publish_weights(full_state_dict(model), folder / f"v{version}.safetensors", version, probe)
                published = time.perf_counter()
                assert await apply_weight_record(engine, record)
                out[kind].append(time.perf_counter() - start)
                out[f"{kind}_publish"].append(published - start)
                out[f"{kind}_load"].append(engine.last_load_seconds)
                out[f"{kind}_bytes"].append(record["num_bytes"])
            for kind in ("lora", "lora_merged"):
                shutil.rmtree(folder / f"{kind}{version}")
            (folder / f"v{version}.safetensors").unlink()
    finally:
        for engine in engines.values():
            engine.close()
    return out


def digest_seconds(state: dict[str, torch.Tensor], folder: Path) -> tuple[float, float]:
    """(trainer-side digests from memory, engine-side digests reading the file) in seconds."""
    from safetensors.torch import save_file

    from molt.engines.refit import file_digests
    from molt.refit import tensor_digest

    start = time.perf_counter()
    sent = {name: tensor_digest(t) for name, t in state.items()}
    middle = time.perf_counter()
    save_file(state, str(folder / "digest.safetensors"))
    middle_end = time.perf_counter()
    assert file_digests(str(folder / "digest.safetensors")) == sent
    return middle - start, time.perf_counter() - middle_end


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--lora", action="store_true", help="adapter refits against merged refits (module docstring)")
    args = ap.parse_args()
    from safetensors.torch import load_file

    from molt.models import resolve_model

    model_dir = resolve_model("smollm2-135m-instruct")
    if args.lora:
        folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
        try:
            times = asyncio.run(lora_against_full(model_dir, folder, args.repeats))
        finally:
            shutil.rmtree(folder, ignore_errors=True)
        median = {kind: statistics.median(times[kind]) for kind in KINDS}
        print("every version, " + " / ".join(KINDS) + " (s): " + "  ".join(
            "/".join(f"{times[kind][i]:.2f}" for kind in KINDS) for i in range(args.repeats)))
        for kind in KINDS:
            publish, load = (statistics.median(times[f"{kind}_{part}"]) for part in ("publish", "load"))
            print(f"  {kind}: {times[f'{kind}_bytes'][0] / 1e6:.1f} MB, median {median[kind]:.2f} s = publish (gather, "
                  f"write || digests || trainer probe) {publish:.2f} + engine load {load:.2f} + the rest (pin, merge, "
                  f"probe and checks) {median[kind] - publish - load:.2f}")
        fewer = times["full_bytes"][0] / times["lora_bytes"][0]
        print(f"lora refit: bytes {fewer:.1f}x fewer, {median['full'] / median['lora']:.1f}x faster served, "
              f"{median['full'] / median['lora_merged']:.1f}x faster merged by the engine")
        return
    state = load_file(str(model_dir / "model.safetensors"))  # the names and tensors an export holds
    folder = Path(tempfile.mkdtemp(dir="/dev/shm"))
    try:
        rows, bases = asyncio.run(alternate(model_dir, folder, args.repeats))
        digests = min((digest_seconds(state, folder) for _ in range(args.repeats)), key=sum)
    finally:
        shutil.rmtree(folder, ignore_errors=True)  # /dev/shm is memory
    base_totals = [write + read for write, read, _ in bases]
    write, read, touch = bases[base_totals.index(min(base_totals))]
    base = write + read
    best = min(rows, key=lambda r: r["total"])
    ours = best["total"]
    size_mb = sum(t.numel() * t.element_size() for t in state.values()) / 1e6
    print(f"{size_mb:.0f} MB, best of {args.repeats} (seconds):")
    print(f"  baseline: write {write:.2f}  map+read {read:.2f} (map+touch only {touch:.2f}; "
          f"molt / (write + touch) {ours / (write + touch):.2f})")
    print(f"  molt: publish (write || digests || trainer probe, done at {best['trainer_probe']:.2f}) "
          f"{best['publish']:.2f}  "
          f"apply {best['apply']:.2f} = engine load (pause, reload + digests, resume) {best['engine_load']:.2f}"
          f" + probe and checks {best['apply'] - best['engine_load']:.2f}")
    print(f"  alone: trainer digests {digests[0]:.2f}  engine-side digests (file) {digests[1]:.2f}; "
          f"FSDP2 gather (not counted) {best['gather']:.2f}; probe max |diff| {best['probe_max_diff']:.1e}")
    print("  every repeat, molt (engine load) / baseline: " + "  ".join(
        f"{r['total']:.2f} ({r['engine_load']:.2f}) / {b:.2f}" for r, b in zip(rows, base_totals)))
    print(f"  medians: molt {statistics.median(r['total'] for r in rows):.2f} (engine load "
          f"{statistics.median(r['engine_load'] for r in rows):.2f}) / baseline "
          f"{statistics.median(base_totals):.2f}")
    print(f"verified refit {ours:.2f} s, /dev/shm write+read {base:.2f} s")
    print(f"ratio refit {ours / base:.2f} (molt {ours:.2f} s / baseline {base:.2f} s)")


if __name__ == "__main__":
    main()
