"""The keys of a pipeline file, typed: the file (`PipelineSpec`), a stage (`StageSpec`), an edge
(`EdgeConfig`); molt.runtime.pipeline validates what they name and builds the graph."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt.policy import PolicySpec
from molt.runtime.placement import PlacementSpec
from molt.runtime.targets import StopWhen

FOLLOWS_WORLD_SIZE = {"follows": "world_size"}  # json_schema_extra of a field that follows it


class EdgeConfig(BaseModel):
    """One edge: ``from: stage[.port]`` -> ``to: stage[.port]``."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    from_: str = Field(alias="from")
    to: str
    kind: Literal["stream", "keyed", "broadcast"] = "stream"
    key: str = "prompt_id"
    feedback: bool = False
    record: bool = False
    capacity: int = Field(4, ge=1, description="credits per consumer replica (batches in flight)")
    hwm: int = Field(64, ge=1, description="ZeroMQ high-water mark (messages)")
    max_message_mib: int = Field(1024, ge=1, description="largest message accepted (MiB)")


class StageSpec(BaseModel):
    """One stage: its class (import path), typed config and processes."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    class_: Any = Field(alias="class")
    config: dict[str, Any] = Field(default_factory=dict)
    replicas: int = Field(1, ge=1)
    world_size: int = Field(1, ge=1, description=">1: a torchrun group; rank 0 owns the sockets")
    cpus: str | int | None = Field(None, description="CPU ids, e.g. '0-1,3'; None = all")
    gpus: str | int | None = Field(None, description="GPU ids shared equally by the replicas, e.g. "
                                   "'0-3'; None = all")

    @model_validator(mode="before")
    @classmethod
    def _no_broadcast_stage(cls, data: Any) -> Any:
        """Refuse the broadcast stage, which the train stage replaced."""
        if isinstance(data, dict) and (data.get("colocate_with")
                                       or data.get("class") == "stages.broadcast.Broadcast"):
            raise ValueError("the broadcast stage (colocate_with: train) is gone: the train stage "
                             "publishes its own weights; hint: remove this stage, connect {from: "
                             "train.weights, to: rollout.weights, kind: broadcast, feedback: true}; "
                             "its config goes in policy.weights (molt.refit)")
        return data


class PipelineSpec(BaseModel):
    """The whole YAML file."""

    model_config = ConfigDict(extra="forbid")
    name: str = "pipeline"
    run_dir: str | None = None
    seed: int = Field(0, description="the run's seed, from which all randomness derives")
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = Field("127.0.0.1", description="the interface tcp edges bind to")
    curve: bool = Field(True, description="tcp edges: CURVE with per-run keys; false = plaintext")
    curve_keys: str | None = Field(None, description="JSON file of CURVE keys; None = generated")
    ready_timeout_s: float = Field(120.0, gt=0)
    stop_timeout_s: float = Field(10.0, gt=0)
    watchdog_s: float | None = Field(900.0, gt=0, description="stop the run when no process has "
                                     "written a metric line for this long; null = never")
    stop_when: StopWhen | None = Field(None, description="end the run when a metric reaches a value")
    keep_checkpoints: int | None = Field(2, ge=1, description="newest complete checkpoints kept; "
                                         "null = all")
    keep_best: str | None = Field(None, description="a metric key: also keep the checkpoint at its "
                                  "highest value")
    results: dict[str, str] = Field(default_factory=dict, description="summary.json results: name "
                                    "-> metric key, e.g. accuracy: evaluate/accuracy")
    placement: PlacementSpec = Field(default_factory=PlacementSpec)  # type: ignore[arg-type]
    requires: dict[str, str] = Field(default_factory=dict, description="model name -> the pipeline "
                                     "YAML that makes it, run first when the cache lacks it")
    policy: PolicySpec = Field(default_factory=PolicySpec,  # type: ignore[arg-type]
                               description="what sampling and training agree on (molt.policy)")
    stages: dict[str, StageSpec]
    edges: list[EdgeConfig] = Field(default_factory=list)
