"""The policy model on a data-parallel group: load, FSDP2-wrap, packed logprobs, export.

FSDP2's reduce-scatter *averages* gradients: the caller multiplies each loss share by the world
size.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import pyarrow as pa
import torch
import torch.distributed as dist
from torch import Tensor, nn

from molt.models.images import (VisionInputs, VisionProcessor, mrope_positions,
                                packed_vision_inputs, row_images)
from molt.models.layout import checkpoint_layout, checkpoint_shapes
from molt.policy import LoraConfig
from molt.runtime.memory import release_freed_memory
from molt.train.attention import (NAME as PACKED_SDPA, register as register_packed_sdpa,
                                  row_lengths, supports_packed_sdpa)
from molt.train.logprobs import target_logprobs, target_logprobs_entropy
from molt.train.lora import apply_lora, is_adapter, merge_lora
from molt.train.moe import RouterHooks, fp32_router_policy, packed_engine_routing, routers
from molt.train.packing import PackedSequence, pack_sequences

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ensure_process_group(device: str = "cpu") -> None:
    """Start a one-rank process group unless one exists."""
    if dist.is_initialized():
        return
    backend = "cpu:gloo,cuda:nccl" if device.startswith("cuda") else "gloo"
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)


def resolve_device(device: str) -> str:
    """The device: "cpu", or "cuda" -> "cuda:LOCAL_RANK" (made current).

    Raises:
        ValueError: a CUDA device without CUDA, or an unknown device type.
    """
    kind = device.split(":")[0]
    if kind == "cpu":
        return "cpu"
    if kind != "cuda":
        raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N'; got {device!r}")
    if not torch.cuda.is_available():
        raise ValueError(f"device is {device!r} but torch {torch.__version__} sees no CUDA device; "
                         "hint: device: cpu")
    index = int(device.split(":")[1]) if ":" in device else int(os.environ.get("LOCAL_RANK", "0"))
    torch.cuda.set_device(index)
    return f"cuda:{index}"


def native_bf16_cpu() -> bool:
    """Whether the CPU has bf16 matmuls in hardware (AVX512-BF16 or AMX-BF16)."""
    try:
        flags = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def check_compute_dtype(compute_dtype: str, device: str) -> None:
    """Refuse an unknown dtype; warn of bf16 on a CPU without bf16 matmuls.

    Raises:
        ValueError: an unknown dtype.
    """
    if compute_dtype not in DTYPES:
        raise ValueError(f"compute_dtype must be one of {sorted(DTYPES)}; got {compute_dtype!r}")
    if compute_dtype == "bfloat16" and device == "cpu" and not native_bf16_cpu():
        logger.warning("bf16 training on a CPU without AVX512-BF16/AMX: steps run 5-40x slower "
                       "than in fp32; hint: policy.precision: float32")


class PolicyModel(nn.Module):
    """A causal LM whose forward gives next-token logprobs; ``router_hooks`` (MoE) and ``vision``
    (VLM) are None otherwise."""

    def __init__(self, lm: nn.Module, temperature: float, chunk_tokens: int = 1024,
                 vision: VisionProcessor | None = None) -> None:
        super().__init__()
        self.lm, self.temperature, self.chunk_tokens = lm, temperature, chunk_tokens
        self.vision = vision
        self.router_hooks = RouterHooks(lm) if routers(lm) else None
        self.checkpoint_shapes: dict[str, tuple[int, ...]] = {}  # of the folder loaded
        self.lora: LoraConfig | None = None
        self.entropy: Tensor | None = None  # [sum of row lengths] of the latest packed forward

    def add_lora(self, config: LoraConfig, where: str = "lora") -> None:
        """Train LoRA adapters instead."""
        apply_lora(self.lm, config, where)
        self.lora = config

    @property
    def shares_prompts(self) -> bool:
        """Whether attention honours shared-prompt segments (molt_packed_sdpa)."""
        text_config = self.lm.config.get_text_config()  # type: ignore[operator, union-attr]
        return bool(getattr(text_config, "_attn_implementation", None) == PACKED_SDPA)

    def forward(self, input_ids: Tensor, position_ids: Tensor, packed: PackedSequence | None = None,
                loss_masks: Sequence[Sequence[bool]] | None = None,
                vision_inputs: VisionInputs | None = None) -> Tensor:
        """Next-token logprobs, fp32, of ``input_ids`` [1, S]; 0 at a row's first token. Without
        ``packed``: [S]. With it: [sum of row lengths], nonzero only at ``loss_masks`` tokens;
        ``self.entropy`` likewise (nats, no gradient)."""
        device = next(self.parameters()).device
        if packed is None:
            kwargs: dict[str, Any] = {"molt_row_lengths": row_lengths(position_ids[0].cpu())}
        elif any(prefix for _, prefix, _ in packed.segments):
            kwargs = {"molt_segments": packed.attention_masks(device)}
        else:
            kwargs = {"molt_row_lengths": [length for length, _, _ in packed.segments]}
        if vision_inputs is not None:
            assert packed is not None, "images are placed by a PackedSequence"
            kwargs.update({name: t.to(device) for name, t in vision_inputs.tensors.items()})
            rope = self.mrope_packed(packed, vision_inputs)
            position_ids = position_ids if rope is None else torch.cat([position_ids[None], rope])
        input_ids, position_ids = input_ids.to(device), position_ids.to(device)
        hidden = self.lm.model(input_ids=input_ids, position_ids=position_ids,  # type: ignore[operator]
                               use_cache=False, **kwargs).last_hidden_state[0]  # [S, H]
        weight = self.lm.get_output_embeddings().weight  # type: ignore[operator]
        if packed is None:
            logp = target_logprobs(hidden[:-1], weight, input_ids[0, 1:], self.temperature,
                                   self.chunk_tokens)
            first = (position_ids[0, 1:] == 0)  # the token starts a new row: no prediction for it
            return torch.cat([logp.new_zeros(1), torch.where(first, 0.0, logp)])
        pred, target, slot = (t.to(device) for t in packed.targets(loss_masks))
        logp, entropy = target_logprobs_entropy(hidden[pred], weight, target, self.temperature,
                                                self.chunk_tokens)
        size = sum(packed.lengths)
        self.entropy = torch.zeros(size, device=device).index_put((slot,), entropy)
        return torch.zeros(size, device=device).index_put((slot,), logp)

    def mrope_packed(self, packed: PackedSequence, vision_inputs: VisionInputs) -> Tensor | None:
        """[3, 1, S] multimodal RoPE positions, or None."""
        rope_index = getattr(self.lm.model, "get_rope_index", None)
        grids = vision_inputs.tensors.get("image_grid_thw")
        if rope_index is None or grids is None or self.vision is None:
            return None
        out = torch.zeros(3, packed.input_ids.shape[1], dtype=torch.long)  # [3, S]
        offset = 0
        for length, images in zip(packed.lengths, vision_inputs.row_images):
            index = packed.token_index[offset:offset + length]
            out[:, index] = mrope_positions(rope_index, packed.input_ids[0, index],
                                            self.vision.image_token_id, grids[images])
            offset += length
        return out[:, None]

    def rows_forward(self, mb: pa.RecordBatch, mask: Tensor, replay: bool = False,
                     compare: bool = False) -> RowsForward:
        """A micro-batch's packed forward (``mask`` [B, T]); ``compare``: one more no-grad forward
        with routing ``replay`` the other way.

        Raises:
            ValueError: images not matching the rows, or recorded experts the model lacks.
        """
        loss_masks, rows, sample_ids = (mb.column(c).to_pylist()
                                        for c in ("loss_mask", "token_ids", "sample_id"))
        images = row_images(mb)
        packed = pack_sequences(rows, loss_masks if self.shares_prompts else None, images)
        vision = packed_vision_inputs(self.vision, rows, images, sample_ids, packed.token_index)
        hooks = self.router_hooks
        if hooks is not None and "routed_experts" in mb.schema.names:
            hooks.engine_routing = packed_engine_routing(
                mb.column("routed_experts").to_pylist(), sample_ids, packed.lengths,
                packed.token_index, packed.input_ids.shape[1], hooks)
            hooks.replay = replay

        def logp() -> Tensor:  # [B, T]
            flat = self(packed.input_ids, packed.position_ids, packed, loss_masks, vision)
            return _unpack(flat, packed, mask)

        try:
            out = RowsForward(logp(), None, None, None)
            out.entropy = _unpack(self.entropy, packed, mask)  # type: ignore[arg-type]
            if hooks is not None:
                out.aux = hooks.aux_loss()
                if compare:  # the other replay setting, without counting its load
                    counts, routing = hooks.counts.clone(), hooks.routing.clone()
                    hooks.replay = not hooks.replay
                    with torch.no_grad():
                        out.other = logp()
                    hooks.counts, hooks.routing, hooks.replay = counts, routing, not hooks.replay
            return out
        finally:
            if hooks is not None:
                hooks.engine_routing = None

    def dummy_forward(self, compare: bool = False) -> Tensor:
        """A zero loss through a 2-token forward, so a rank without rows keeps its collectives in
        step; MoE load counts skip it."""
        packed = pack_sequences([[0, 0]])
        hooks = self.router_hooks
        if hooks is not None:
            hooks.active = False
        try:
            loss = self(packed.input_ids, packed.position_ids).sum() * 0.0
            if hooks is not None and compare:  # expert-parallel all-to-alls pair with other ranks'
                with torch.no_grad():
                    self(packed.input_ids, packed.position_ids)
            return loss
        finally:
            if hooks is not None:
                hooks.active = True


@dataclass
class RowsForward:
    """[B, T] per token (0 past a row's end)."""

    logp: Tensor  # logprobs of the loss tokens (with gradient), 0 elsewhere
    entropy: Tensor | None  # of the sampling distribution at the loss tokens (nats, no gradient)
    aux: Tensor | None  # MoE: this forward's load-balancing loss (0-dim, with gradient)
    other: Tensor | None  # MoE with compare: logp with routing replay the other way (no gradient)


def _unpack(flat: Tensor, packed: PackedSequence, mask: Tensor) -> Tensor:
    """[B, T] (0 past a row's end) of packed values [sum lengths]."""
    dev = flat.device
    lengths = torch.tensor(packed.lengths, device=dev)[:, None]
    valid = torch.arange(mask.shape[1], device=dev)[None, :] < lengths
    return torch.zeros(mask.shape, device=dev).masked_scatter(valid, flat)


def load_policy(model_dir: str | Path, temperature: float, chunk_tokens: int = 1024) -> PolicyModel:
    """Load a HF folder in fp32 (the master weights), in train mode; ``sdpa`` attention becomes
    ``molt_packed_sdpa``."""
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

    vision = VisionProcessor.of(model_dir)
    auto = AutoModelForImageTextToText if vision is not None else AutoModelForCausalLM
    lm = auto.from_pretrained(str(model_dir), dtype=torch.float32)
    lm.config.use_cache = False
    text = lm.config.get_text_config()
    if supports_packed_sdpa(text) and text._attn_implementation == "sdpa":
        name = register_packed_sdpa()
        lm.set_attn_implementation({"text_config": name} if vision else name)
    model = PolicyModel(lm, temperature, chunk_tokens, vision)
    model.checkpoint_shapes = checkpoint_shapes(model_dir)  # the layout exports are written in
    release_freed_memory()  # the loader's copies
    return model.train()


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The decoder layers of a causal LM or a VLM."""
    base = cast(nn.Module, lm.model)
    return cast(nn.ModuleList, getattr(base, "language_model", base).layers)


def shard_policy(model: PolicyModel, compute_dtype: str = "float32", device: str = "cpu",
                 expert_parallel_size: int = 1) -> PolicyModel:
    """FSDP2-shard each decoder layer, then the wrapper (as in torchtitan); "bfloat16" computes
    over fp32 master weights; one rank in fp32 is left unwrapped.

    Raises:
        ValueError: unknown ``compute_dtype`` or ``device``; an ``expert_parallel_size`` other
            than 1 or the world size, or a model it cannot shard.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    device = resolve_device(device)
    check_compute_dtype(compute_dtype, device)
    ensure_process_group(device)
    if device != "cpu":
        model.to(device)
    world = dist.get_world_size()
    if expert_parallel_size not in (1, world):
        raise ValueError(f"expert_parallel_size must be 1 or the train stage's world size {world}; "
                         f"got {expert_parallel_size}")
    if world == 1 and compute_dtype == "float32":
        return model  # nothing to shard, cast or reduce
    mesh = init_device_mesh(device.split(":")[0], (world,))
    experts: set[nn.Parameter] = set()
    if expert_parallel_size > 1:
        from molt.train.expert_parallel import shard_experts

        experts = shard_experts(model.lm, mesh, "expert_parallel_size")
    policy = MixedPrecisionPolicy(param_dtype=DTYPES[compute_dtype], reduce_dtype=torch.float32)
    for router in routers(model.lm):  # MoE: routing stays fp32
        fully_shard(router, mesh=mesh, mp_policy=fp32_router_policy())
    for layer in decoder_layers(model.lm):
        fully_shard(layer, mesh=mesh, mp_policy=policy, ignored_params=experts)
    fully_shard(model, mesh=mesh, mp_policy=policy, ignored_params=experts)
    return model


def export_names(model: PolicyModel) -> dict[str, str]:
    """Wrapper state-dict names (LoRA: merged) -> the HF folder's."""
    tied = bool(getattr(model.lm.config, "tie_word_embeddings", False))
    names = {}
    for name in model.state_dict():
        if is_adapter(name):
            continue
        name = name.replace(".base_layer.", ".")
        hf = name.removeprefix("lm.")
        if not (tied and hf == "lm_head.weight"):
            names[name] = hf
    return names


def full_state_dict(model: PolicyModel) -> dict[str, Tensor]:
    """The `checkpoint_state` on CPU; a collective: rank 0 gets it, the others an empty dict."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    full = get_model_state_dict(model, options=options)
    return checkpoint_state(model, cast(dict[str, Tensor], full))


def checkpoint_state(model: PolicyModel, full: dict[str, Tensor]) -> dict[str, Tensor]:
    """``full`` (the wrapper's names) as ``save_pretrained`` writes it, in the folder's layout."""
    from transformers.core_model_loading import revert_weight_conversion

    if model.lora is not None:
        full = merge_lora(full, model.lora.scaling)
    names = export_names(model)
    state = {names[k]: v for k, v in full.items() if k in names}
    if state:
        state = revert_weight_conversion(model.lm, state)  # type: ignore[arg-type]
    return {name: checkpoint_layout(tensor, model.checkpoint_shapes.get(name)).contiguous()
            for name, tensor in state.items()}
