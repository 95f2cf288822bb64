"""The pipeline's ``policy:`` block: what the stages that sample from or train the policy agree on.

    policy: {precision: float32, temperature: 0.8}

`check_group_filters` refuses a group filter under a staleness bound (``max_staleness``, a
policy fact the rollout and trainer share) whose drops the rollout does not hear of. A stage
config field declared with `policy_field` names the fact it holds. Where the YAML leaves it
unset, it takes the block's value when the pipeline loads (`apply_policy`); where the YAML sets
it (an override), the value is checked against the block:

- ``temperature``: the trainer computes the logprobs of the distribution the engine sampled
  from (``rollout_logprobs`` are after temperature), so every stated value must be the same;
  a contradiction fails at load naming both keys. (A trainer at 1.0 against a rollout at 0.8
  biases every importance ratio by about 10%.) Unstated everywhere, it is 1.0.
- ``precision``: the trainer computes in the precision the engines sample in (DESIGN §10), so
  an on-policy step has ratio 1 within fp32 tolerance. A stage set otherwise is the user's
  choice: allowed, and warned about at load with what it costs.

Measured (the quickstart's first step, strictly on-policy, a 2-core Xeon with AMX): a bf16
trainer against an fp32 engine logged |logprob diff| mean 0.027, max 0.39 and ratio max 1.38;
both in fp32 7e-6, 1e-4 and 1.0001.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

if TYPE_CHECKING:
    from molt.pipeline import Pipeline

logger = logging.getLogger(__name__)
Precision = Literal["float32", "bfloat16"]
MISMATCH_COST = ("the trainer's logprobs then differ from the engine's (a bf16 trainer against an fp32 engine, "
                 "the quickstart's first on-policy step: |logprob diff| mean 0.027, max 0.39, ratio max 1.38 "
                 "instead of 1.0001), so keep a correction (TIS/IcePop) on")


class PolicySpec(BaseModel):
    """The ``policy:`` block of a pipeline (DESIGN §1, §10)."""

    model_config = ConfigDict(extra="forbid")
    precision: Precision = Field(
        "float32", description="trainer compute and engine sampling alike; bfloat16 on GPUs (and CPUs with "
        "AVX512-BF16/AMX, unmeasured for learning); fp32 keeps an on-policy ratio at 1 within 1e-4")
    temperature: float | None = Field(None, gt=0, description="sampling temperature of the rollout engines and "
                                      "the trainer's logprobs; None = as the stages state it (else 1.0)")


def policy_field(fact: Literal["precision", "temperature"], default: Any, **kwargs: Any) -> Any:
    """A pydantic ``Field`` holding policy fact ``fact``: unset in the YAML, it takes the pipeline's
    ``policy.<fact>``; set, it is checked against it (`apply_policy`)."""
    return Field(default, json_schema_extra={"policy": fact}, **kwargs)


def _marked(config: BaseModel, where: str) -> Iterator[tuple[BaseModel, str, str, str]]:
    """(model, field name, fact, YAML key) of every `policy_field` of ``config``, nested configs included."""
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "policy" in extra:
            yield config, name, str(extra["policy"]), f"{where}.{name}"
        elif isinstance(value := getattr(config, name), BaseModel):
            yield from _marked(value, f"{where}.{name}")


def filled(config: BaseModel) -> dict[str, Any]:
    """The `policy_field` s of ``config`` that took the block's value, as a ``model_dump`` ``exclude``:
    a resolved pipeline (a run's ``pipeline.yaml``) states them once, in its ``policy:`` block."""
    out: dict[str, Any] = {}
    for name, field in type(config).model_fields.items():
        extra = field.json_schema_extra
        if isinstance(extra, dict) and "policy" in extra:
            if name not in config.model_fields_set:
                out[name] = True
        elif isinstance(value := getattr(config, name), BaseModel) and (inner := filled(value)):
            out[name] = inner
    return out


def apply_policy(policy: PolicySpec, configs: dict[str, BaseModel], source: str) -> list[str]:
    """Give every stage config's unset `policy_field` the block's value (stage id -> config, in place);
    logs and returns one warning per stage whose precision differs from ``policy.precision``.

    Example: policy {precision: float32} and a train stage with ``compute_dtype: bfloat16``
    -> ["...: stages.train.config.compute_dtype is bfloat16 but policy.precision is float32 ..."].

    Raises:
        ValueError: two stated temperatures differ (``policy.temperature`` or a stage's), naming both keys.
    """
    fields = [f for sid, c in configs.items() for f in _marked(c, f"stages.{sid}.config")]
    stated = [(key, getattr(model, name)) for model, name, fact, key in fields
              if fact == "temperature" and name in model.model_fields_set]
    if policy.temperature is not None:
        stated.insert(0, ("policy.temperature", policy.temperature))
    for key, value in stated[1:]:
        if value != stated[0][1]:
            raise ValueError(f"{source}: {key} is {value} but {stated[0][0]} is {stated[0][1]}; the trainer's "
                             "logprobs must be those of the distribution the rollout sampled from; hint: state "
                             "it once, as policy.temperature, and remove the stages' keys")
    agreed = {"temperature": stated[0][1] if stated else None, "precision": policy.precision}
    warnings = []
    for model, name, fact, key in fields:
        if name not in model.model_fields_set:
            if agreed[fact] is not None:
                try:  # the field's own bounds hold (a rollout may sample at 0, a trainer may not)
                    model.__pydantic_validator__.validate_assignment(model, name, agreed[fact])
                except ValidationError as e:
                    raise ValueError(f"{source}: {key}: {e.errors()[0]['msg']}; got {agreed[fact]!r} from "
                                     f"{'policy.' + fact if fact == 'precision' else stated[0][0]}") from None
                model.model_fields_set.discard(name)  # the block's value, not the stage's (`filled`)
        elif fact == "precision" and getattr(model, name) != policy.precision:
            warnings.append(f"{source}: {key} is {getattr(model, name)} but policy.precision is {policy.precision}: "
                            f"{MISMATCH_COST}; hint: set policy.precision instead, for trainer and engines alike")
            logger.warning(warnings[-1])
    return warnings


def check_group_filters(pipe: Pipeline) -> None:
    """Refuse a stage that drops whole groups downstream of one that admits them under a staleness
    bound (``max_staleness`` set) unless the filter's ``drops`` output reaches that stage's ``drops``
    input over a broadcast edge: without the notices it counts a dropped group as trained and waits
    for a version that never comes (a deadlock seen with max_staleness 0, two groups a step and one
    flat group). A notice does not say which rollout made the group, so one replica may be bounded."""
    for sid, n in pipe.stages.items():
        if not n.cls.drops_groups:
            continue
        upstream: set[str] = set()
        frontier = {sid}
        while frontier := {e.src for e in pipe.edges if e.dst in frontier and not e.cfg.feedback} - upstream:
            upstream |= frontier
        bounds = {up: getattr(pipe.stages[up].config, "max_staleness", None) for up in sorted(upstream)}
        bounded = {up: bound for up, bound in bounds.items() if bound is not None}
        for up, bound in bounded.items():
            if not any(e.src == sid and e.src_port == "drops" and e.dst == up and e.dst_port == "drops" and
                       e.cfg.kind == "broadcast" for e in pipe.edges):
                raise ValueError(
                    f"{pipe.source}: stages.{sid} drops whole groups, downstream of stages.{up}, which admits groups "
                    f"under stages.{up}.config.max_staleness {bound}: without notices of the "
                    f"drops it counts a dropped group as trained and would wait for a version that never comes; "
                    f"hint: stages.{sid}.config.notify_drops: true, stages.{up}.config.drops_input: true and the "
                    f"edge {{from: {sid}.drops, to: {up}.drops, kind: broadcast, feedback: true}}")
        if (replicas := sum(pipe.stages[up].replicas for up in bounded)) > 1:
            raise ValueError(f"{pipe.source}: stages.{sid} drops whole groups made by {replicas} rollout replicas "
                             f"under a max_staleness bound ({', '.join(f'stages.{u}' for u in bounded)}): a drop "
                             "notice does not say which one made the group; hint: one bounded replica, or "
                             "max_staleness: null (the train stage still refuses stale tokens)")
