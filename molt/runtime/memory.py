"""Memory the process no longer uses, handed back to the OS."""

from __future__ import annotations

import ctypes
import resource

import torch


def release_freed_memory() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim(0)``; a no-op without glibc),
    which glibc keeps otherwise: call it after loading a model and after each optimizer step."""
    if (trim := getattr(ctypes.CDLL(None), "malloc_trim", None)) is not None:
        trim(0)


def peak_memory_gb(device: str) -> float:
    """Peak memory of this rank: CUDA allocator peak on GPU, else the process's peak RSS."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KiB on Linux
