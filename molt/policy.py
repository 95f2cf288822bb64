"""The pipeline's ``policy:`` block: the facts that the stages sampling from or training
the policy must agree on.

    policy:
      model: smollm2-135m-instruct
      precision: float32              # trainer compute and engine sampling
      temperature: 0.8                # the rollout samples at it, the trainer scores at it
      groups_per_step: 16             # rollout admission and pack
      max_staleness: 1                # versions a trained token may lag behind
      weights: {keep_versions: 1}     # molt.refit.PublishConfig
      tool_parser: hermes
      lora: {rank: 16, alpha: 32}

A `policy_field` unset in the YAML takes the block's value at load (`apply_policy`), else
the value a stage states. Set, it is checked by its ``relation``: ``equal``, or the load
fails naming both keys; ``at_most`` (the rollout's max_staleness), no looser than the agreed
bound, or null; ``warn`` (precision), with a warning of its cost (`MISMATCH_COST`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from molt.config import differing_keys
from molt.refit import PublishConfig

logger = logging.getLogger(__name__)
Precision = Literal["float32", "bfloat16"]
Fact = Literal["model", "precision", "temperature", "groups_per_step", "max_staleness", "weights",
               "tool_parser", "lora"]
Relation = Literal["equal", "at_most", "warn"]
MISMATCH_COST = ("the trainer's logprobs then differ from the engine's (a bf16 trainer against "
                 "an fp32 engine, the quickstart's first on-policy step: |logprob diff| mean "
                 "0.027, max 0.39, ratio max 1.38 instead of 1.0001), so keep a correction "
                 "(TIS/IcePop) on")


class LoraConfig(BaseModel):
    """``policy.lora``: which linears get adapters, and their shape."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(16, ge=1, description="r: the adapters' inner dimension")
    alpha: int = Field(32, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="on the adapters' input in training; "
                           "> 0 makes an on-policy ratio differ from 1")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                 "down_proj"],
        min_length=1, description="linear modules by name suffix (peft's matching); a MoE's "
        "fused experts are parameters, not linears")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class PolicySpec(BaseModel):
    """The ``policy:`` block; an unset fact is as the stages state it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="local folder, hub id or built-in name")
    precision: Precision = Field("float32", description="trainer compute and engine sampling alike")
    temperature: float | None = Field(
        None, gt=0, description="of the engines' sampling and the trainer's logprobs (else 1.0)")
    groups_per_step: int | None = Field(None, ge=1, description="prompt groups per optimizer step")
    max_staleness: int | None = Field(
        None, ge=0, description="policy versions a trained token may lag behind")
    weights: PublishConfig | None = Field(None, description="how the trainer publishes its weights")
    tool_parser: str | None = Field(
        None, description="hermes (default) or a molt.agents.tools.ToolParser's import path")
    lora: LoraConfig | None = Field(None, description="train low-rank adapters (molt.train.lora)")


def policy_field(fact: Fact, default: Any = None, relation: Relation | None = None,
                 **kwargs: Any) -> Any:
    """A pydantic ``Field`` holding ``fact``; ``relation``: warn for precision, else equal."""
    relation = relation or ("warn" if fact == "precision" else "equal")
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    return Field(json_schema_extra={"policy": fact, "relation": relation}, **kwargs)


def _marked(config: BaseModel, where: str) -> Iterator[tuple[BaseModel, str, str, str, str]]:
    """(model, field name, fact, relation, YAML key) of every `policy_field`, nested too."""
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "policy" in extra:
            yield config, name, str(extra["policy"]), str(extra["relation"]), f"{where}.{name}"
        elif isinstance(value := getattr(config, name), BaseModel):
            yield from _marked(value, f"{where}.{name}")


def filled(config: BaseModel) -> dict[str, Any]:
    """The `policy_field` s that took the agreed value, as a ``model_dump`` ``exclude``."""
    out: dict[str, Any] = {}
    for model, name, _, _, key in _marked(config, ""):
        if name not in model.model_fields_set:
            node = out
            for part in key.split(".")[1:-1]:  # the nested configs' field names
                node = node.setdefault(part, {})
            node[name] = True
    return out


def apply_policy(policy: PolicySpec, configs: dict[str, BaseModel], source: str) -> list[str]:
    """Give every unset `policy_field` of ``configs`` (stage id -> config, in place) the agreed
    value; returns (and logs) the precision warnings.

    Raises:
        ValueError: a stated value contradicts the agreed one, naming both keys.
    """
    fields = [f for sid, c in configs.items() for f in _marked(c, f"stages.{sid}.config")]
    warnings = []
    for fact in Fact.__args__:  # type: ignore[attr-defined]
        mine = [(model, name, rel, key) for model, name, f, rel, key in fields if f == fact]
        stated = [(key, getattr(model, name), rel) for model, name, rel, key in mine
                  if name in model.model_fields_set]
        agreed: tuple[str, Any] | None = next(
            ((key, v) for key, v, rel in stated if rel == "equal"), None)
        if getattr(policy, fact) is not None:  # None: unstated (precision always is)
            agreed = (f"policy.{fact}", getattr(policy, fact))
        for key, value, rel in stated:
            if agreed is None or key == agreed[0]:
                continue
            if rel == "warn" and value != agreed[1]:
                warnings.append(f"{source}: {key} is {value} but {agreed[0]} is {agreed[1]}: "
                                f"{MISMATCH_COST}; hint: set policy.precision instead, for "
                                "trainer and engines alike")
                logger.warning(warnings[-1])
            elif (rel == "equal" and value != agreed[1]) or (
                    rel == "at_most" and None not in (value, agreed[1]) and value > agreed[1]):
                strictly = " (a rollout may admit only more strictly)" if rel == "at_most" else ""
                raise ValueError(f"{source}: {_first_difference(key, value, *agreed)}{strictly}; "
                                 f"hint: state it once, as policy.{fact}, and remove the "
                                 "stages' keys")
        for model, name, _, key in mine:
            if name not in model.model_fields_set and agreed is not None and agreed[1] is not None:
                try:  # the field's own bounds hold (a rollout may sample at 0, a trainer may not)
                    model.__pydantic_validator__.validate_assignment(model, name, agreed[1])
                except ValidationError as e:
                    raise ValueError(f"{source}: {key}: {e.errors()[0]['msg']}; got "
                                     f"{agreed[1]!r} from {agreed[0]}") from None
                model.model_fields_set.discard(name)  # the agreed value, not the stage's (`filled`)
    return warnings


def _first_difference(key: str, value: Any, other_key: str, other: Any) -> str:
    """"KEY is VALUE but OTHER_KEY is OTHER", down to the first field where two configs differ."""
    if isinstance(value, BaseModel) and isinstance(other, BaseModel):
        mine: Any = value.model_dump(mode="json")
        theirs: Any = other.model_dump(mode="json")
        field = differing_keys(mine, theirs)[0]
        for part in field.split("."):
            mine, theirs = (d.get(part) if isinstance(d, dict) else None for d in (mine, theirs))
        key, value, other_key, other = f"{key}.{field}", mine, f"{other_key}.{field}", theirs
    return f"{key} is {value} but {other_key} is {other}"
