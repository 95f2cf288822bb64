"""Typed config from YAML: loading, ``--set`` overrides, classes by import path, and errors
naming file, dotted path and nearest valid key ("...: unknown key; did you mean 'x'?")."""

from __future__ import annotations

import difflib
import importlib
import typing
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError


class FrozenConfig(BaseModel):
    """Base of the sub-configs selected by their ``type:``: immutable, unknown keys fail."""

    model_config = ConfigDict(extra="forbid", frozen=True)


def load_yaml(path: Path, _derived: tuple[Path, ...] = ()) -> dict[str, Any]:
    """A pipeline's YAML mapping from ``path``; duplicate keys are errors.

    A file may name a ``base:`` pipeline (relative to it) and state what differs: mappings
    merge recursively unless their ``type`` differs, other values (``edges`` too) replace the
    base's, and a stage set to null is removed with its edges.

    Raises:
        ValueError: naming the file: missing, not UTF-8 or YAML, not a mapping, a bad or
            circular base, or a removed stage the base lacks.
    """
    data = _read_yaml(path)
    if (base := data.pop("base", None)) is None:
        return data
    file = (path.parent / str(base)).resolve()
    if not isinstance(base, str) or not file.is_file():
        raise ValueError(f"{path}: base: {base!r} is not a pipeline file (a path relative to "
                         f"{path.parent})")
    if file in (*_derived, path.resolve()):
        raise ValueError(f"{path}: base: {base} leads back to a file that names it: bases form a "
                         "circle; hint: a base names a more general pipeline, never one derived "
                         "from this file")
    parent = load_yaml(file, (*_derived, path.resolve()))
    beside(parent, file)  # the base's requires: from its own folder
    gone = {sid for sid, stage in (data.get("stages") or {}).items() if stage is None}
    if unknown := sorted(gone - set(parent.get("stages") or {})):
        raise ValueError(f"{path}: stages.{unknown[0]}: null removes a stage of the base, and "
                         f"{base} has no stage {unknown[0]!r}; stages: "
                         f"{sorted(parent.get('stages') or {})}")
    merged = _merge(parent, data)
    merged["stages"] = {sid: s for sid, s in merged.get("stages", {}).items() if sid not in gone}
    if gone and "edges" not in data:
        merged["edges"] = [
            e for e in merged.get("edges", []) if isinstance(e, dict)
            and not gone & {str(e.get(end, "")).partition(".")[0] for end in ("from", "to")}]
    return merged


def _merge(base: Any, over: Any) -> Any:
    if (isinstance(base, dict) and isinstance(over, dict)
            and over.get("type", base.get("type")) == base.get("type")):
        return {**base, **{k: _merge(base[k], v) if k in base else v for k, v in over.items()}}
    return over


def _read_yaml(path: Path) -> dict[str, Any]:
    if not path.is_file():
        raise ValueError(f"{path}: pipeline file not found")
    try:
        data = yaml.load(path.read_text(encoding="utf-8"), Loader=_UniqueKeyLoader)
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: invalid YAML: {e}") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text: byte {e.object[e.start]:#04x} at offset "
                         f"{e.start}; hint: save the pipeline as UTF-8") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a pipeline is a mapping with 'stages' and 'edges'")
    return data


class _UniqueKeyLoader(yaml.SafeLoader):
    """Refuses duplicate keys, which plain YAML silently overwrites."""


def _construct_mapping(loader: yaml.SafeLoader, node: yaml.MappingNode,
                       deep: bool = False) -> dict:
    seen = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r} (stage ids must be unique)",
                key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def apply_override(data: dict[str, Any], item: str, source: str) -> None:
    """Apply one override such as ``edges[0].capacity=8`` (or ``edges.0.capacity=8``; the
    value is YAML) in place; ValueError for no ``=``, bad YAML or a path through a leaf."""
    if "=" not in item:
        raise ValueError(f"--set {item!r}: expected KEY=VALUE, e.g. "
                         "stages.source.config.num_groups=4")
    key, value = item.split("=", 1)
    parts = key.replace("[", ".").replace("]", "").split(".")
    node: Any = data
    for i, name in enumerate(parts):
        part: str | int = name
        if isinstance(node, list):
            if not name.isdigit() or int(name) >= len(node):
                raise ValueError(f"{source}: --set {key}: {'.'.join(parts[:i + 1])}: no such "
                                 f"list index (the list has {len(node)} items)")
            part = int(name)
        elif not isinstance(node, dict):
            raise ValueError(f"{source}: --set {key}: {'.'.join(parts[:i])} is neither a "
                             "mapping nor a list")
        if i == len(parts) - 1:
            try:
                node[part] = yaml.safe_load(value)
            except yaml.YAMLError as e:
                raise ValueError(f"{source}: --set {item}: the value is not YAML: {e}; hint: "
                                 "quote the whole item in the shell, e.g. --set 'key=[1, 2]'"
                                 ) from None
        else:
            node = node.setdefault(part, {}) if isinstance(node, dict) else node[part]


def validate(model: type[BaseModel], data: Any, source: str, prefix: tuple) -> Any:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        err = e.errors()[0]
        at, keys = _walk(model, tuple(err["loc"])[:-1])
        loc = prefix + at + tuple(err["loc"])[-1:]
        path = "".join(f"[{p}]" if isinstance(p, int) else f".{p}" for p in loc).lstrip(".")
        msg = err["msg"]
        if err["type"] == "extra_forbidden":
            close = difflib.get_close_matches(str(loc[-1]), keys, n=1)
            msg = "unknown key" + (f"; did you mean {close[0]!r}?" if close
                                   else f"; valid keys: {keys}")
        elif err["type"] != "missing":
            msg += f"; got {err.get('input')!r}"
        raise ValueError(f"{source}: {path}: {msg}") from None


def _walk(model: Any, loc: tuple) -> tuple[tuple, list[str]]:
    """``loc`` without the tags pydantic puts in it for a tagged union's member, and the field
    names (YAML spelling) of the model it reaches."""
    at: list[Any] = []
    for part in (*loc, None):  # None: unwrap the last one (an Optional model or a union)
        while not (isinstance(model, type) and issubclass(model, BaseModel)):
            args = [a for a in typing.get_args(model) if a is not type(None)]
            origin = typing.get_origin(model)
            if origin is typing.Annotated:
                args = args[:1]
            tagged = [a for a in args if isinstance(a, type) and issubclass(a, BaseModel)
                      and getattr(a.model_fields.get("type"), "default", None) == part]
            if not args:
                return tuple(at), []
            model = tagged[0] if tagged else args[-1]
            if tagged or origin in (list, tuple, dict):  # no field: a tag, an index or a key
                at += [] if tagged else [part]  # a tag is not a YAML key
                break
        else:
            if part is None:
                break
            f = model.model_fields.get(str(part)) or next(
                (v for v in model.model_fields.values() if v.alias == part), None)
            model = f.annotation if f else None
            at.append(part)
    if not (isinstance(model, type) and issubclass(model, BaseModel)):
        return tuple(at), []
    return tuple(at), [f.alias or n for n, f in model.model_fields.items()]


def import_class(path: str, where: str) -> type:
    """Import ``pkg.module.Class``; ValueError naming ``where`` and the nearest existing name."""
    module_name, _, attr = path.rpartition(".")
    if not module_name:
        raise ValueError(f"{where}: {path!r} is not an import path like "
                         "'stages.my_stage.MyStage'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ValueError(f"{where}: cannot import module {module_name!r}: {e}") from None
    if not hasattr(module, attr):
        close = difflib.get_close_matches(attr, dir(module), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"{where}: module {module_name!r} has no class {attr!r}{hint}")
    return getattr(module, attr)


def beside(data: dict[str, Any], path: Path) -> None:
    """Resolve ``data["requires"]`` in place from the folder of the YAML ``path``, not from
    where ``molt run`` starts."""
    if isinstance(data.get("requires"), dict):
        data["requires"] = {k: str((path.parent / v).resolve()) if isinstance(v, str) else v
                            for k, v in data["requires"].items()}


def check_requires(requires: dict[str, str], source: str) -> None:
    """ValueError naming ``requires.NAME`` unless NAME is a model name and its file exists."""
    for name, file in requires.items():
        if "/" in name or not Path(file).is_file():
            raise ValueError(f"{source}: requires.{name}: a model name (no '/') and an existing "
                             f"pipeline file; got {name!r}: {file!r}; hint: requires: "
                             "{MODEL_NAME: other_pipeline.yaml}")


def differing_keys(a: Any, b: Any, prefix: str = "") -> list[str]:
    """The dotted keys at which two YAML trees differ, e.g. ["a.c"]."""
    if isinstance(a, dict) and isinstance(b, dict):
        keys = sorted(set(a) | set(b), key=str)
        return [k for key in keys
                for k in differing_keys(a.get(key), b.get(key), f"{prefix}{key}.")]
    return [] if a == b else [prefix.rstrip(".")]
