"""Causal attention over packed rows, with no [S, S] mask.

A packed micro-batch is one sequence [1, S] whose ``position_ids`` restart at 0 for every row.
transformers' ``sdpa`` would compute all S^2 scores under a block-diagonal mask; the rows need
only sum_r n_r^2 / 2. `packed_sdpa` splits q, k, v at the row starts and runs transformers'
``sdpa_attention_forward`` causally on each row, exactly as if alone (on CUDA in bf16, one
``varlen_attn`` call). It is registered as ``molt_packed_sdpa``; `supports_packed_sdpa` keeps
models whose masks carry more than causality on ``sdpa``.

Example: position_ids [[0, 1, 2, 0, 1]] -> row lengths [3, 2] -> SDPA on tokens 0..2 and 3..4.
Shape legend: B batch, H heads, S tokens, D head size.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

NAME = "molt_packed_sdpa"


def row_lengths(position_ids: Tensor) -> list[int]:
    """Lengths of the rows packed in one ``position_ids`` row [S] (module docstring example)."""
    starts = torch.diff(position_ids) != 1  # [S - 1], true where token t + 1 starts a row
    bounds = [0] + (starts.nonzero()[:, 0] + 1).tolist() + [position_ids.shape[0]]
    return [b - a for a, b in zip(bounds, bounds[1:])]


def packed_sdpa(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                attention_mask: Tensor | None, **kwargs: Any) -> tuple[Tensor, None]:
    """Attention output [B, S, H, D] of query [B, H, S, D], key/value [B, H_kv, S, D], row by row
    (rows from ``kwargs["position_ids"]`` [B or 1, S])."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    position_ids = kwargs.pop("position_ids", None)
    lengths = kwargs.pop("molt_row_lengths", None)
    segments = kwargs.pop("molt_segments", None)
    kwargs.pop("is_causal", None)
    if attention_mask is not None or position_ids is None or query.shape[2] != key.shape[2]:
        return sdpa_attention_forward(  # type: ignore[no-any-return]
            module, query, key, value, attention_mask, **kwargs)
    if segments is not None and query.shape[0] == 1:  # shared-prompt segments
        parts = zip(*(t.split([n for n, _ in segments], dim=2) for t in (query, key, value)))
        outs = [sdpa_attention_forward(module, q, k, v, None if m is None else m[None, None],
                                       is_causal=m is None, **kwargs)[0]
                for (q, k, v), (_, m) in zip(parts, segments)]
        return torch.cat(outs, dim=1), None
    half = query.dtype in (torch.bfloat16, torch.float16)
    if query.is_cuda and half and query.shape[0] == 1 and _varlen():
        lengths = lengths or row_lengths(position_ids[0])
        return _varlen_rows(module, query, key, value, lengths), None
    outputs = []
    for b in range(query.shape[0]):
        if lengths is None or query.shape[0] > 1:
            lengths = row_lengths(position_ids[min(b, position_ids.shape[0] - 1)])
        rows = zip(*(t[b:b + 1].split(lengths, dim=2) for t in (query, key, value)))
        outputs.append(torch.cat([sdpa_attention_forward(module, q, k, v, None, is_causal=True,
                                                         **kwargs)[0] for q, k, v in rows], dim=1))
    return torch.cat(outputs), None


def _varlen() -> Any:
    """torch's ``varlen_attn`` (PyTorch >= 2.10), or None."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    return varlen_attn


def _varlen_rows(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                 lengths: list[int]) -> Tensor:
    """`packed_sdpa` in one ``varlen_attn`` call (its keywords vary across PyTorch releases).

    Raises:
        ValueError: a scale other than 1/sqrt(D) where ``varlen_attn`` takes none.
    """
    import inspect

    varlen_attn = _varlen()
    params = inspect.signature(varlen_attn).parameters
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))  # [S, H or H_kv, D]
    scale = getattr(module, "scaling", None)
    kwargs: dict[str, Any] = {"is_causal": True}
    if "window_size" in params:
        kwargs = {"window_size": (-1, 0)}
    if "scale" in params:
        kwargs["scale"] = scale
    elif scale is not None and abs(scale - q.shape[-1] ** -0.5) > 1e-6:
        raise ValueError(f"attention scale {scale} is not 1/sqrt(head size); torch "
                         f"{torch.__version__}'s varlen_attn takes no scale")
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in params:
            kwargs["enable_gqa"] = True
        else:
            k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    offsets = torch.tensor([0, *lengths], dtype=torch.int32).cumsum(0, dtype=torch.int32)  # [R + 1]
    offsets, longest = offsets.to(q.device), max(lengths)
    return varlen_attn(  # type: ignore[no-any-return]
        q, k, v, offsets, offsets, longest, longest, **kwargs)[None]


def _packed_mask(*, attention_mask: Tensor | None = None, **kwargs: Any) -> Tensor | None:
    """No mask for unpadded input (`packed_sdpa` finds the rows), else transformers' sdpa mask."""
    from transformers.masking_utils import sdpa_mask

    return None if attention_mask is None else sdpa_mask(attention_mask=attention_mask, **kwargs)


def supports_packed_sdpa(config: Any) -> bool:
    """Whether every layer is plain causal attention (no window, chunk or bidirectional part)."""
    windowed = (getattr(config, "sliding_window", None) is not None
                and getattr(config, "use_sliding_window", True))
    return bool(getattr(config, "is_causal", True) and not windowed
                and not getattr(config, "is_encoder_decoder", False)
                and getattr(config, "attention_chunk_size", None) is None
                and set(getattr(config, "layer_types", None) or ["full_attention"])
                == {"full_attention"})


def register() -> str:
    """Register `packed_sdpa` and its mask function with transformers; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(NAME, packed_sdpa)
    AttentionMaskInterface.register(NAME, _packed_mask)
    return NAME
