"""The pipeline's ``policy:`` block: what the stages that sample from or train the policy agree on.

    policy:
      model: smollm2-135m-instruct           # rollout, train, evaluate and SFT records alike
      precision: float32                      # trainer compute and engine sampling alike
      temperature: 0.8                        # the rollout samples at it, the trainer scores at it
      groups_per_step: 16                     # rollout admission and pack
      max_staleness: 1                        # the trainer's bound; a rollout may admit more strictly
      weights: {keep_versions: 1}             # how the trainer publishes its weights output (molt.refit)
      tool_parser: hermes                     # the format of tool calls: rollout, evaluation and SFT records alike
      lora: {rank: 16, alpha: 32}             # the trainer trains adapters, the engines serve them (molt.train.lora)

A stage config field declared with `policy_field` names the fact it holds. Where the YAML leaves
it unset, it takes the block's value when the pipeline loads (`apply_policy`), or, where the block
leaves the fact out, the value a stage states (so a fact stated once anywhere holds for all).
Where the YAML sets it (an override), the value is checked, by the field's ``relation``:

- ``equal`` (model, temperature, groups_per_step, the trainer's max_staleness, weights, tool_parser, lora): every
  stated value must be the same; a contradiction fails at load naming both keys. (A trainer's
  temperature at 1.0 against a rollout at 0.8 biases every importance ratio by about 10%: the
  trainer must compute the logprobs of the distribution the engine sampled from.)
- ``at_most`` (the rollout's max_staleness): no looser than the agreed bound, since the trainer
  refuses older tokens; a stricter admission is meaningful (replicas running unevenly stay within
  the trainer's bound), and so is none (null: admission unbounded, the trainer's bound still holds;
  molt.runtime.pipeline.check_group_filters asks for it where a bound cannot be kept).
- ``warn`` (precision): the trainer computes in the precision the engines sample in (DESIGN §10),
  so an on-policy step has ratio 1 within fp32 tolerance. A stage set otherwise is the user's
  choice: allowed, and warned about at load with what it costs.

molt.runtime.pipeline.check_group_filters refuses a group filter under a staleness bound whose drops the rollout does
not hear of. (Measured, the quickstart's first on-policy step: `MISMATCH_COST`.)
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
Fact = Literal["model", "precision", "temperature", "groups_per_step", "max_staleness", "weights", "tool_parser", "lora"]
Relation = Literal["equal", "at_most", "warn"]
MISMATCH_COST = ("the trainer's logprobs then differ from the engine's (a bf16 trainer against an fp32 engine, "
                 "the quickstart's first on-policy step: |logprob diff| mean 0.027, max 0.39, ratio max 1.38 "
                 "instead of 1.0001), so keep a correction (TIS/IcePop) on")


class LoraConfig(BaseModel):
    """``policy.lora`` (or the train stage's ``lora``): which linears get adapters, and their shape."""

    model_config = ConfigDict(extra="forbid")
    rank: int = Field(16, ge=1, description="r: the adapters' inner dimension")
    alpha: int = Field(32, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="on the adapters' input while training; > 0 makes the "
                           "trainer's forward random, so an on-policy ratio is no longer 1")
    target_modules: list[str] = Field(
        default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
        min_length=1, description="linear modules by name suffix (peft's matching), e.g. [q_proj, v_proj]; "
        "each must match a linear: a MoE's fused experts are parameters, not linears (name the attention's)")

    @property
    def scaling(self) -> float:
        return self.alpha / self.rank


class PolicySpec(BaseModel):
    """The ``policy:`` block of a pipeline (DESIGN §1, §10); an unset fact is as the stages state it."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = Field(None, description="local folder, hub id or built-in name the policy starts from")
    precision: Precision = Field(
        "float32", description="trainer compute and engine sampling alike; bfloat16 on GPUs (and CPUs with "
        "AVX512-BF16/AMX, unmeasured for learning); fp32 keeps an on-policy ratio at 1 within 1e-4")
    temperature: float | None = Field(None, gt=0, description="sampling temperature of the rollout engines and "
                                      "the trainer's logprobs (else 1.0)")
    groups_per_step: int | None = Field(None, ge=1, description="prompt groups per optimizer step")
    max_staleness: int | None = Field(None, ge=0, description="policy versions a trained token may lag behind")
    weights: PublishConfig | None = Field(None, description="how the trainer publishes its weights output")
    tool_parser: str | None = Field(None, description="the format of the policy's tool calls: hermes (default) or a "
                                    "molt.agents.tools.ToolParser's import path")
    lora: LoraConfig | None = Field(None, description="train low-rank adapters (molt.train.lora); engines then serve "
                                    "each version's adapter (molt.engines.vllm)")


def policy_field(fact: Fact, default: Any = None, relation: Relation | None = None, **kwargs: Any) -> Any:
    """A pydantic ``Field`` holding policy fact ``fact``: unset in the YAML, it takes the agreed value;
    set, it is checked against it by ``relation`` (default: warn for precision, else equal)."""
    relation = relation or ("warn" if fact == "precision" else "equal")
    if "default_factory" not in kwargs:
        kwargs["default"] = default
    return Field(json_schema_extra={"policy": fact, "relation": relation}, **kwargs)


def _marked(config: BaseModel, where: str) -> Iterator[tuple[BaseModel, str, str, str, str]]:
    """(model, field name, fact, relation, YAML key) of every `policy_field` of ``config``, nested configs
    included."""
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "policy" in extra:
            yield config, name, str(extra["policy"]), str(extra["relation"]), f"{where}.{name}"
        elif isinstance(value := getattr(config, name), BaseModel):
            yield from _marked(value, f"{where}.{name}")


def filled(config: BaseModel) -> dict[str, Any]:
    """The `policy_field` s of ``config`` that took the agreed value, as a ``model_dump`` ``exclude``:
    a resolved pipeline (a run's ``pipeline.yaml``) states them once, in its ``policy:`` block."""
    out: dict[str, Any] = {}
    for model, name, _, _, key in _marked(config, ""):
        if name not in model.model_fields_set:
            node = out
            for part in key.split(".")[1:-1]:  # the nested configs' field names
                node = node.setdefault(part, {})
            node[name] = True
    return out


def apply_policy(policy: PolicySpec, configs: dict[str, BaseModel], source: str) -> list[str]:
    """Give every stage config's unset `policy_field` the agreed value (stage id -> config, in place):
    the block's, else the first ``equal`` value a stage states; logs and returns one warning per stage
    whose precision differs from ``policy.precision``.

    Example: policy {model: m, groups_per_step: 16} and a pack stage without groups_per_step -> 16;
    a train stage with ``compute_dtype: bfloat16`` -> ["...: stages.train.config.compute_dtype is
    bfloat16 but policy.precision is float32 ..."].

    Raises:
        ValueError: a stated value contradicts the agreed one (module docstring), naming both keys.
    """
    fields = [f for sid, c in configs.items() for f in _marked(c, f"stages.{sid}.config")]
    warnings = []
    for fact in Fact.__args__:  # type: ignore[attr-defined]
        mine = [(model, name, rel, key) for model, name, f, rel, key in fields if f == fact]
        stated = [(key, getattr(model, name), rel) for model, name, rel, key in mine if name in model.model_fields_set]
        agreed: tuple[str, Any] | None = next(((key, v) for key, v, rel in stated if rel == "equal"), None)
        if getattr(policy, fact) is not None:  # None: unstated (precision always is)
            agreed = (f"policy.{fact}", getattr(policy, fact))
        for key, value, rel in stated:
            if agreed is None or key == agreed[0]:
                continue
            if rel == "warn" and value != agreed[1]:
                warnings.append(f"{source}: {key} is {value} but {agreed[0]} is {agreed[1]}: {MISMATCH_COST}; "
                                "hint: set policy.precision instead, for trainer and engines alike")
                logger.warning(warnings[-1])
            elif (rel == "equal" and value != agreed[1]) or (rel == "at_most" and None not in (value, agreed[1])
                                                              and value > agreed[1]):  # a rollout may admit more strictly
                raise ValueError(f"{source}: {_first_difference(key, value, *agreed)}"
                                 f"{' (a rollout may admit only more strictly)' if rel == 'at_most' else ''}; "
                                 f"hint: state it once, as policy.{fact}, and remove the stages' keys")
        for model, name, _, key in mine:
            if name not in model.model_fields_set and agreed is not None and agreed[1] is not None:
                try:  # the field's own bounds hold (a rollout may sample at 0, a trainer may not)
                    model.__pydantic_validator__.validate_assignment(model, name, agreed[1])
                except ValidationError as e:
                    raise ValueError(f"{source}: {key}: {e.errors()[0]['msg']}; got {agreed[1]!r} from "
                                     f"{agreed[0]}") from None
                model.model_fields_set.discard(name)  # the agreed value, not the stage's (`filled`)
    return warnings


def _first_difference(key: str, value: Any, other_key: str, other: Any) -> str:
    """"KEY is VALUE but OTHER_KEY is OTHER", down to the first field where two configs differ:
    e.g. "stages.train.config.weights.keep_versions is 3 but policy.weights.keep_versions is 1"."""
    if isinstance(value, BaseModel) and isinstance(other, BaseModel):
        mine: Any = value.model_dump(mode="json")
        theirs: Any = other.model_dump(mode="json")
        field = differing_keys(mine, theirs)[0]
        for part in field.split("."):
            mine, theirs = (d.get(part) if isinstance(d, dict) else None for d in (mine, theirs))
        key, value, other_key, other = f"{key}.{field}", mine, f"{other_key}.{field}", theirs
    return f"{key} is {value} but {other_key} is {other}"
