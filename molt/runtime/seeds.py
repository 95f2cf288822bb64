"""The run's seed: every random choice of a pipeline derives from its top-level ``seed:``.

A stage draws its own stream with ``ctx.seed_for(*parts)`` = ``derive_seed(seed, stage id,
*parts)``; a stage config's own ``seed:`` wins. A seed repeats a transformers-engine rollout token
for token, not a vLLM one (requests share batches as they arrive); ``molt replay`` repeats a run.
"""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from a run seed and names: blake2b of ``"seed/part/part..."``.

    ``derive_seed(0, "rollout", 0) != derive_seed(0, "rollout", 1)``, both the same on every
    machine; ``derive_seed(7, "q1/0")`` seeds request ``q1/0`` in the transformers engine.
    """
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
