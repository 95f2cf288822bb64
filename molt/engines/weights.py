"""Reading refit weights and fingerprinting them, shared by engines and trainer.

A refit passes full Hugging Face-named weights as one safetensors file (on one
host: in /dev/shm). Each engine fingerprints every tensor as it consumes it,
so the sender can compare with the fingerprints of what it wrote: a refit that
silently loads stale or different bytes is caught by comparing two dicts.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open


def tensor_digest(tensor: torch.Tensor) -> str:
    """Fingerprint a tensor's dtype, shape and raw bytes.

    Returns:
        A 32-hex-digit BLAKE2b digest; equal for two tensors exactly when
        (barring collisions) dtype, shape and every byte are equal.
    """
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    hasher = hashlib.blake2b(digest_size=16)
    hasher.update(f"{flat.dtype}|{tuple(tensor.shape)}|".encode())
    hasher.update(flat.view(torch.uint8).numpy().data)
    return hasher.hexdigest()


def check_weights_file(path: str) -> None:
    """Refuse a weights path that is not an existing safetensors file.

    Raises:
        ValueError: if `path` does not exist or does not end in .safetensors.
    """
    if not path.endswith(".safetensors") or not os.path.isfile(path):
        raise ValueError(f"weights must be an existing .safetensors file; got {path!r}; "
                         "hint: export with safetensors.torch.save_file, ideally to /dev/shm")


def iter_weights(path: str,
                 digests: dict[str, str] | None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (name, tensor) from a safetensors file, recording each digest.

    Args:
        path: a .safetensors file of HF-named tensors.
        digests: filled in place with name -> `tensor_digest` of each tensor as
            it is yielded (so it covers exactly what the consumer received);
            None skips digesting.
    """
    with safe_open(path, framework="pt") as handle:
        for name in handle.keys():
            tensor = handle.get_tensor(name)
            if digests is not None:
                digests[name] = tensor_digest(tensor)
            yield name, tensor


def file_digests(path: str) -> dict[str, str]:
    """Digest every tensor of a safetensors file: name -> `tensor_digest`."""
    digests: dict[str, str] = {}
    for _ in iter_weights(path, digests):
        pass
    return digests


def mismatched_digests(sent: dict[str, str], received: dict[str, str]) -> list[str]:
    """Names whose digest differs or that only one side has, sorted.

    Example: mismatched_digests({"a": "1", "b": "2"}, {"a": "1", "b": "3"}) == ["b"].
    An empty list means the receiver consumed exactly the bytes that were sent.
    """
    names = set(sent) | set(received)
    return sorted(name for name in names if sent.get(name) != received.get(name))


def verify_refit(version: int, sent: dict[str, str], loaded: dict[str, str]) -> None:
    """Check that the engine loaded exactly the tensors the trainer exported.

    ``sent`` maps tensor names to the trainer's :func:`tensor_digest` (the
    weight-version record's ``tensor_names``/``tensor_digests``), ``loaded`` the
    digests the engine computed as its loader consumed each tensor.

    Raises:
        RuntimeError: naming the tensors that differ or were not loaded.
    """
    bad = sorted(n for n, d in sent.items() if loaded.get(n) != d)
    if bad:
        raise RuntimeError(f"refit to version {version} is not verified: {len(bad)} tensor(s) differ "
                           f"or were not loaded, e.g. {bad[:5]}")


async def apply_weight_record(engine: Any, record: dict[str, Any]) -> bool:
    """Load the weights a weight-version record (molt.schema.WEIGHT_VERSION_SCHEMA row)
    points to into ``engine`` if they are newer, and verify every tensor's digest.

    Returns True when a refit happened. Raises RuntimeError on a digest mismatch.
    """
    if record["policy_version"] <= engine.policy_version:
        return False
    await engine.load_weights(record["uri"].removeprefix("file://"), record["policy_version"])
    verify_refit(record["policy_version"], dict(zip(record["tensor_names"], record["tensor_digests"])),
                 getattr(engine, "last_weight_digests", {}))
    return True


def publish_weights(state: dict[str, torch.Tensor], path: Path, version: int) -> dict[str, Any]:
    """Write ``state`` (HF names -> tensors) as one safetensors file at ``path``
    atomically (temp name, then rename) and return its weight-version record
    (a molt.schema.WEIGHT_VERSION_SCHEMA row) with every tensor's digest."""
    from safetensors.torch import save_file

    tmp = path.with_suffix(".tmp")
    save_file(state, str(tmp), metadata={"format": "pt", "policy_version": str(version)})
    os.replace(tmp, path)
    digests = {name: tensor_digest(t) for name, t in state.items()}
    return {"policy_version": version, "uri": f"file://{path}", "format": "safetensors",
            "num_bytes": sum(t.numel() * t.element_size() for t in state.values()),
            "tensor_names": list(digests), "tensor_digests": list(digests.values()), "created_unix_s": time.time()}
