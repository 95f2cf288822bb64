"""The run's seed: every random choice of a pipeline derives from its top-level ``seed:``.

``seed: 3`` (or ``molt run --seed 3``) reaches every stage as ``ctx.seed``; a stage
draws its own stream with ``ctx.seed_for(*parts)`` = :func:`derive_seed` (seed,
stage id, parts), so two stages, or two replicas given their index as a part, never
share a stream, and two seeds give independent runs. What derives from it:

- the dataset's order (``DatasetSource``: the per-epoch shuffle; every replica the same
  permutation, so their shares stay disjoint), and the synthetic source's groups;
- each engine's sampling seed (rollout and evaluation, per replica): vLLM's engine-wide
  ``seed``, the transformers engine's per-request generators (``(seed, request_id)``);
- the trainer's ``torch.manual_seed`` (all ranks alike).

A stage config's explicit ``seed:`` still wins. A task's own ``seed`` (which arithmetic
problems or pictures exist) is part of the task, not of the run: the held-out set is the
same yardstick for every seed.

What the same seed repeats (measured, README "How sure is a result?"): with the
transformers engine every sample is a function of (seed, request id), so a rollout
repeats token for token, and so does a run at ``max_staleness: 0`` up to batch-variant
kernels (a row's logprobs depend on what it is packed with: in bf16 by tenths of a nat).
vLLM's engine-wide seed fixes the stream of its sampler, not which request each draw
goes to: requests join decode batches as they arrive, so two vLLM runs of one seed
part within their first tokens (rollout_only.yaml: 0 of 64 samples alike, 1.4 tokens in
common on average). With ``max_staleness`` >= 1, which version generated a token also
depends on when refits land.
Exact repetition comes from ``molt replay`` of recorded trajectories.
"""

from __future__ import annotations

import hashlib


def derive_seed(seed: int, *parts: object) -> int:
    """A 63-bit seed from a run seed and names: blake2b of ``"seed/part/part..."``.

    Example: ``derive_seed(0, "rollout", 0) != derive_seed(0, "rollout", 1)``; both are
    the same on every run and machine. ``derive_seed(7, "q1/0")`` is the transformers
    engine's generator seed of request ``q1/0`` under seed 7.
    """
    text = "/".join(str(p) for p in (seed, *parts))
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1
