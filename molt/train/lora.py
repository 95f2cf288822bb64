"""LoRA: low-rank adapters on a frozen policy (Hu et al. 2021, "LoRA", arXiv:2106.09685), through peft.

`apply_lora` puts peft's LoRA layers into the loaded policy in place (``peft.inject_adapter_in_model``:
the model stays its transformers class, so FSDP2, the packed attention, routing replay and ``lr_scale``
see the same modules) and freezes every other parameter; the optimizer then holds state for the
adapters only (molt.train.optim takes trainable parameters). A targeted linear computes
``W x + (alpha / rank) * B (A x)`` with ``A [rank, in]`` (Kaiming-uniform) and ``B [out, rank]`` (zeros),
so the policy at version 0 is the base model.

A refit is the adapter alone (`adapter_state`, molt.train.publish; merged where routers train in full).
Checkpoints' ``model.safetensors`` and ``export_model`` hold merged weights, ``W + (alpha / rank) * B @ A``
under the base model's names (`merge_lora`). A checkpoint also holds the adapter alone in peft's format
(`save_adapter`: ``adapter/``, loadable with ``peft.PeftModel.from_pretrained`` or as a vLLM ``LoRARequest``);
a resumed trainer reloads its base from ``policy.model`` and the adapter from there (`load_adapter`).

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
    """Add adapters to ``lm``'s linears named by ``config.target_modules`` (in place) and freeze every
    other parameter but a MoE's routers that still train (molt.train.moe: ``freeze_router: false``, which
    they then do in full: peft's ``modules_to_save``). `PolicyModel.add_lora` calls it.

    Raises:
        ValueError: a target matches no module, or a module that is not a linear, is a router or the output
            head (naming ``where``).
    """
    from peft import inject_adapter_in_model
    from peft.tuners.lora import Linear, LoraLayer

    router_ids = {id(router) for router in routers(lm)}
    router_params = {id(p) for router in routers(lm) for p in router.parameters() if p.requires_grad}
    output_head = lm.get_output_embeddings()  # type: ignore[operator]
    exclude = outside_language_model(lm)
    try:
        inject_adapter_in_model(peft_config(config, exclude=exclude), lm, adapter_name=ADAPTER)
    except ValueError as err:
        raise ValueError(f"{where}.target_modules: {err}") from err
    adapted = [name for name, module in lm.named_modules() if isinstance(module, LoraLayer)]
    if idle := [t for t in config.target_modules if not any(n == t or n.endswith(f".{t}") for n in adapted)]:
        raise ValueError(f"{where}.target_modules: {idle} match no linear layer of the "
                         f"{'language ' * bool(exclude)}model (a MoE's experts are fused parameters, not linears); "
                         "hint: e.g. [q_proj, k_proj, v_proj, o_proj]")
    for name, module in lm.named_modules():
        base = module.get_base_layer() if isinstance(module, LoraLayer) else None
        head = base is not None and base is output_head  # vLLM's LoRA there breaks the refit probe (engines.vllm_lora)
        if base is not None and (id(base) in router_ids or not isinstance(module, Linear) or head):
            what = "a router" if id(base) in router_ids else "the output head" if head else type(base).__name__
            raise ValueError(f"{where}.target_modules: {name} is {what}; adapters go on the decoder's linear layers, "
                             "routers train in full (freeze_router: false) or not at all")
    for name, param in lm.named_parameters():
        param.requires_grad_(is_adapter(name) or id(param) in router_params)


def outside_language_model(lm: nn.Module) -> str | None:
    """peft's ``exclude_modules`` for a vision-language ``lm``: a regex of every module outside its language
    model (the module transformers' ``get_decoder`` finds, whatever the tower is called), which vLLM does not
    adapt and whose q/k/v_proj a CLIP tower has too; None for a text model."""
    if not hasattr(lm.config, "vision_config"):
        return None
    decoder = lm.get_decoder()  # type: ignore[operator]
    prefix = next(name for name, module in lm.named_modules() if module is decoder)
    if not prefix:
        raise ValueError(f"lora: {type(lm).__name__} has a vision_config but transformers finds no language model "
                         "inside it (get_decoder), so its tower cannot be kept free of adapters")
    return rf"^(?!{re.escape(prefix)}\.).*"


def peft_config(config: LoraConfig, base: str | None = None, exclude: str | None = None):  # -> peft.LoraConfig
    """peft's LoraConfig for ``config`` (``base``: the model folder, written as base_model_name_or_path;
    ``exclude``: the modules no adapter goes on, `outside_language_model`)."""
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(r=config.rank, lora_alpha=config.alpha, lora_dropout=config.dropout, bias="none",
                          target_modules=list(config.target_modules), base_model_name_or_path=base,
                          exclude_modules=exclude)


def is_adapter(name: str) -> bool:
    """Whether a parameter name is one of peft's adapter tensors (``...lora_A.default.weight``)."""
    return ".lora_" in name


def merge_lora(state: dict[str, Tensor], scaling: float) -> dict[str, Tensor]:
    """A state dict under the base model's names with each adapted weight merged.

    ``X.base_layer.weight`` [out, in] becomes ``X.weight`` = it + ``scaling`` * ``X.lora_B.default.weight``
    [out, rank] @ ``X.lora_A.default.weight`` [rank, in] (molt.refit.merge_adapter); ``X.base_layer.bias``
    becomes ``X.bias``; adapter tensors are dropped. A state dict without adapters comes back as it was.
    """
    merged = {}
    for name, value in state.items():
        if is_adapter(name):
            continue
        module, base, leaf = name.partition(".base_layer.")
        if base and leaf == "weight":
            a, b = state[f"{module}.lora_A.{ADAPTER}.weight"], state[f"{module}.lora_B.{ADAPTER}.weight"]
            value = merge_adapter(value, a, b, scaling)
        merged[f"{module}.{leaf}" if base else name] = value
    return merged


def save_adapter(folder: Path, state: dict[str, Tensor], model: nn.Module, lora: LoraConfig, base: str | None) -> None:
    """Write the trained tensors of ``state`` (``model``'s names) into ``folder`` in peft's format.

    ``adapter_model.safetensors``: adapters as ``base_model.model.X.lora_A.weight``, parameters trained
    in full (routers) as ``base_model.model.X.weight``; ``adapter_config.json``: peft's LoraConfig with
    base_model_name_or_path ``base`` and those modules as ``modules_to_save``.
    """
    trained = trained_names(model)
    folder.mkdir(parents=True, exist_ok=True)
    tensors = {_peft_name(k): v.contiguous() for k, v in state.items() if k in trained}
    save_file(tensors, str(folder / ADAPTER_FILE), metadata={"format": "pt"})
    write_adapter_config(folder, lora, base, sorted({k.rsplit(".", 2)[-2] for k in trained if not is_adapter(k)}),
                         outside_language_model(getattr(model, "lm", model)))


def write_adapter_config(folder: Path, lora: LoraConfig, base: str | None, modules_to_save: list[str] | None = None,
                         exclude: str | None = None) -> None:
    """``folder/adapter_config.json``: peft's LoraConfig of ``lora`` (base_model_name_or_path ``base``;
    ``exclude``: `peft_config`)."""
    config = peft_config(lora, base, exclude)
    config.modules_to_save = modules_to_save or None  # peft: None, not []
    (folder / "adapter_config.json").write_text(json.dumps(config.to_dict(), default=list, indent=2))


def adapters_only(model: nn.Module) -> bool:
    """Whether only adapters train (no router in full): then an adapter alone carries a version."""
    return all(is_adapter(name) for name in trained_names(model))


def adapter_state(model: nn.Module) -> dict[str, Tensor]:
    """The adapters, whole, on the CPU, under peft's file names (``base_model.model.X.lora_A.weight``
    [rank, in], ``...lora_B.weight`` [out, rank]); a collective under FSDP2 (each is all-gathered), so
    every rank calls it."""
    from torch.distributed.tensor import DTensor

    return {_peft_name(name): (p.full_tensor() if isinstance(p, DTensor) else p).detach().cpu().contiguous()
            for name, p in model.named_parameters() if is_adapter(name)}


def load_adapter(folder: Path, model: nn.Module, lora: LoraConfig, base: Path) -> dict[str, Tensor]:
    """The tensors `save_adapter` wrote, under ``model``'s parameter names (adapters of ``lora`` on the model
    folder ``base``).

    Raises:
        ValueError: a file is missing, the adapter's rank, alpha or dropout is not ``lora``'s, or its tensors
            differ from ``model``'s trained ones (a folder other than ``base`` is warned about: a path cannot
            tell a moved model from another one).
    """
    path = folder / ADAPTER_FILE
    if not path.is_file() or not (folder / "adapter_config.json").is_file():
        raise ValueError(f"checkpoint {folder}: no {ADAPTER_FILE} or adapter_config.json; hint: the run trained "
                         "without lora, or the checkpoint is incomplete")
    saved_config = json.loads((folder / "adapter_config.json").read_text())
    if (trained_on := saved_config.get("base_model_name_or_path")) and Path(trained_on).resolve() != base.resolve():
        logger.warning("checkpoint %s: its adapter was trained on %s; policy.model is %s: unless that is the same "
                       "model moved, the adapter does not apply to it", folder, trained_on, base)
    if differ := [f"{key} {saved_config.get(peft)} (now {value})" for key, peft, value in (
            ("rank", "r", lora.rank), ("alpha", "lora_alpha", lora.alpha), ("dropout", "lora_dropout", lora.dropout))
            if saved_config.get(peft) != value]:
        raise ValueError(f"checkpoint {folder}: its adapter has lora {', '.join(differ)}; hint: resume with the "
                         "lora settings the run was started with")
    state = model.state_dict()
    own = {_peft_name(k): (k, tuple(state[k].shape)) for k in trained_names(model)}
    with safe_open(str(path), framework="pt") as handle:
        saved = {k: tuple(handle.get_slice(k).get_shape()) for k in handle.keys()}
        if saved != {k: shape for k, (_, shape) in own.items()}:
            diff = sorted(k for k in set(saved) | set(own) if saved.get(k) != own.get(k, (0, None))[1])
            raise ValueError(f"checkpoint {path}: adapter tensors differ from the model's in names or shapes, e.g. "
                             f"{diff[:3]}; hint: resume with the lora settings the run was started with")
        return {name: handle.get_tensor(k) for k, (name, _) in own.items()}


def trained_names(model: nn.Module) -> set[str]:
    """State-dict names of the parameters that train (a LoRA model's adapters and routers)."""
    return {name for name, param in model.named_parameters() if param.requires_grad}


def _peft_name(name: str) -> str:
    """peft's file name of a parameter: ``lm.X.lora_A.default.weight`` -> ``base_model.model.X.lora_A.weight``."""
    return PEFT_PREFIX + name.removeprefix("lm.").replace(f".{ADAPTER}.", ".")
