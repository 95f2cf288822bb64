"""LoRA: low-rank adapters on a frozen policy (Hu et al. 2021, arXiv:2106.09685), through peft.

`apply_lora` injects peft's LoRA layers in place (the model keeps its class, so FSDP2 and the
hooks see the same modules) and freezes the rest. A targeted linear computes
``W x + (alpha / rank) * B (A x)``, ``B`` zeros at first, so version 0 is the base model.
Refits ship the adapter alone (`adapter_state`) unless routers train in full; checkpoints hold
merged weights (`merge_lora`) and the adapter in peft's format (`save_adapter`, `load_adapter`).

    policy: {lora: {rank: 8, alpha: 16, target_modules: [q_proj, k_proj, v_proj, o_proj]}}
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path

from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from molt.policy import LoraConfig
from molt.refit import ADAPTER_FILE, PEFT_PREFIX, merge_adapter
from molt.train.moe import routers

logger = logging.getLogger(__name__)
ADAPTER = "default"  # peft's adapter name inside the model


def apply_lora(lm: nn.Module, config: LoraConfig, where: str = "lora") -> None:
    """Add adapters to ``lm``'s ``target_modules`` and freeze the rest but training routers.

    Raises:
        ValueError: naming ``where``: a target matching no linear, a router or the output head.
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear, LoraLayer

    found = routers(lm)
    router_ids = {id(router) for router in found}
    router_params = {id(p) for router in found for p in router.parameters() if p.requires_grad}
    output_head = lm.get_output_embeddings()  # type: ignore[operator]
    exclude = outside_language_model(lm)
    try:
        inject_adapter_in_model(peft_config(config, exclude=exclude), lm, adapter_name=ADAPTER)
    except ValueError as err:
        raise ValueError(f"{where}.target_modules: {err}") from err
    adapted = [name for name, module in lm.named_modules() if isinstance(module, LoraLayer)]
    idle = [t for t in config.target_modules
            if not any(n == t or n.endswith(f".{t}") for n in adapted)]
    if idle:
        raise ValueError(f"{where}.target_modules: {idle} match no linear layer of the "
                         f"{'language ' * bool(exclude)}model (a MoE's experts are fused "
                         "parameters, not linears); hint: e.g. [q_proj, k_proj, v_proj, o_proj]")
    for name, module in lm.named_modules():
        base = module.get_base_layer() if isinstance(module, LoraLayer) else None
        head = base is not None and base is output_head  # vLLM's LoRA there breaks the refit probe
        router = base is not None and id(base) in router_ids
        if base is not None and (router or not isinstance(module, Linear) or head):
            what = "a router" if router else "the output head" if head else type(base).__name__
            raise ValueError(f"{where}.target_modules: {name} is {what}; adapters go on the "
                             "decoder's linear layers, routers train in full (freeze_router: "
                             "false) or not at all")
    for name, param in lm.named_parameters():
        param.requires_grad_(is_adapter(name) or id(param) in router_params)


def outside_language_model(lm: nn.Module) -> str | None:
    """peft's ``exclude_modules``: a regex of every module outside a VLM's language model, which
    vLLM does not adapt; None for a text model."""
    if not hasattr(lm.config, "vision_config"):
        return None
    decoder = lm.get_decoder()  # type: ignore[operator]
    prefix = next(name for name, module in lm.named_modules() if module is decoder)
    if not prefix:
        raise ValueError(f"lora: {type(lm).__name__} has a vision_config but transformers finds no "
                         "language model inside it (get_decoder), so its tower cannot be kept free "
                         "of adapters")
    return rf"^(?!{re.escape(prefix)}\.).*"


def peft_config(config: LoraConfig, base: str | None = None,
                exclude: str | None = None):  # -> peft.LoraConfig
    """peft's LoraConfig of ``config`` on model folder ``base``, no adapter on ``exclude``."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout,
                          bias="none", target_modules=list(config.target_modules),
                          base_model_name_or_path=base, exclude_modules=exclude)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is one of peft's adapter tensors (``...lora_A.default.weight``)."""
    return ".lora_" in name


def merge_lora(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """``state`` under the base model's names: ``X.base_layer.weight`` becomes ``X.weight`` +
    ``scaling`` * B @ A, adapters are dropped."""
    merged = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        module, base, leaf = name.partition(".base_layer.")
        if base and leaf == "weight":
            a, b = (state[f"{module}.lora_{x}.{ADAPTER}.weight"] for x in "AB")
            value = merge_adapter(value, a, b, scaling)
        merged[f"{module}.{leaf}" if base else name] = value
    return merged


def save_adapter(folder: Path, state: dict[str, Tensor], model: nn.Module, lora: LoraConfig,
                 base: str | None) -> None:
    """Write the trained tensors of ``state`` into ``folder`` in peft's format (routers trained in
    full as ``modules_to_save``)."""
    trained = trained_names(model)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {_peft_name(k): v.contiguous() for k, v in state.items() if k in trained}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    in_full = sorted({k.rsplit(".", 2)[-2] for k in trained if not is_adapter(k)})
    exclude = outside_language_model(getattr(model, "lm", model))
    write_adapter_config(folder, lora, base, in_full, exclude)


def write_adapter_config(folder: Path, lora: LoraConfig, base: str | None,
                         modules_to_save: list[str] | None = None,
                         exclude: str | None = None) -> None:
    """``folder/adapter_config.json``: `peft_config` with ``modules_to_save``."""
    config = peft_config(lora, base, exclude)
    config.modules_to_save = modules_to_save or None  # peft: None, not []
    text = json.dumps(config.to_dict(), default=list, indent=2)
    (folder / "adapter_config.json").write_text(text)


def adapters_only(model: nn.Module) -> bool:
    """Whether only adapters train (no router in full), so an adapter alone carries a version."""
    return all(is_adapter(name) for name in trained_names(model))


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters, whole, on the CPU, under peft's file names; a collective under FSDP2."""
    from torch.distributed.tensor import DTensor

    return {_peft_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu()
            .contiguous() for name, p in model.named_parameters() if is_adapter(name)}


def load_adapter(folder: Path, model: nn.Module, lora: LoraConfig, base: Path) -> dict[str, Tensor]:
    """The tensors `save_adapter` wrote, under ``model``'s names; warns if trained on another base.

    Raises:
        ValueError: a missing file, or a rank, alpha, dropout or tensor other than the model's.
    """
    path, config_path = folder / ADAPTER_FILE, folder / "adapter_config.json"
    if not path.is_file() or not config_path.is_file():
        raise ValueError(f"checkpoint {folder}: no {ADAPTER_FILE} or adapter_config.json; hint: "
                         "the run trained without lora, or the checkpoint is incomplete")
    saved_config = json.loads(config_path.read_text())
    trained_on = saved_config.get("base_model_name_or_path")
    if trained_on and Path(trained_on).resolve() != base.resolve():
        logger.warning("checkpoint %s: its adapter was trained on %s; policy.model is %s: unless "
                       "that is the same model moved, the adapter does not apply to it", folder,
                       trained_on, base)
    ours = (("rank", "r", lora.rank), ("alpha", "lora_alpha", lora.alpha),
            ("dropout", "lora_dropout", lora.dropout))
    if differ := [f"{key} {saved_config.get(peft)} (now {value})" for key, peft, value in ours
                  if saved_config.get(peft) != value]:
        raise ValueError(f"checkpoint {folder}: its adapter has lora {', '.join(differ)}; hint: "
                         "resume with the lora settings the run was started with")
    state = model.state_dict()
    own = {_peft_name(k): (k, tuple(state[k].shape)) for k in trained_names(model)}
    with safe_open(str(path), framework="pt") as handle:
        saved = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        if saved != {k: shape for k, (_, shape) in own.items()}:
            diff = sorted(k for k in set(saved) | set(own)
                          if saved.get(k) != own.get(k, (0, None))[1])
            raise ValueError(f"checkpoint {path}: adapter tensors differ from the model's in names "
                             f"or shapes, e.g. {diff[:3]}; hint: resume with the lora settings the "
                             "run was started with")
        return {name: handle.get_tensor(k) for k, (name, _) in own.items()}


def trained_names(model: nn.Module) -> set[str]:
    """Names of the parameters that train (a LoRA model's adapters and routers)."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def _peft_name(name: str) -> str:
    """``lm.X.lora_A.default.weight`` -> peft's ``base_model.model.X.lora_A.weight``."""
    return PEFT_PREFIX + name.removeprefix("lm.").replace(f".{ADAPTER}.", ".")
