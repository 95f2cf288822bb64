"""The keys of a pipeline file, typed (pydantic): the whole file (`PipelineSpec`), each stage (`StageSpec`)
and each edge (`EdgeConfig`); molt.runtime.pipeline validates what they name and builds the graph.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from molt.runtime.placement import PlacementSpec
from molt.policy import PolicySpec
from molt.runtime.targets import StopWhen

FOLLOWS_WORLD_SIZE = {"follows": "world_size"}  # a config field's json_schema_extra: `_follow_world_size`


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
    max_message_mib: int = Field(1024, ge=1, description="largest message a consumer accepts (MiB); larger "
                                 "ones fail the run naming the edge and producer")


class StageSpec(BaseModel):
    """One stage: its class (import path), typed config and process kind."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    class_: Any = Field(alias="class")
    config: dict[str, Any] = Field(default_factory=dict)
    replicas: int = Field(1, ge=1)
    world_size: int = Field(1, ge=1, description=">1: a torchrun group; rank 0 owns the sockets")
    cpus: str | int | None = Field(None, description="CPU ids the stage's processes run on, e.g. '0' or '0-1,3': "
                             "affinity, OpenMP threads and vLLM's CPU binding (molt.runtime.runner); None = all")
    gpus: str | int | None = Field(None, description="GPU ids shared out among the replicas, e.g. '0-3' for 4 replicas "
                             "of 1 GPU or 2 of a 2-rank group: CUDA_VISIBLE_DEVICES (molt.runtime.runner); None = all")

    @model_validator(mode="before")
    @classmethod
    def _no_broadcast_stage(cls, data: Any) -> Any:
        """A pipeline written for the broadcast stage, fused into the trainer, that the trainer replaced."""
        if isinstance(data, dict) and (data.get("colocate_with") or data.get("class") == "stages.broadcast.Broadcast"):
            raise ValueError("the broadcast stage (colocate_with: train) is gone: the train stage publishes its own "
                             "weights; hint: remove this stage, connect {from: train.weights, to: rollout.weights, "
                             "kind: broadcast, feedback: true}; its config goes in policy.weights (molt.refit)")
        return data


class PipelineSpec(BaseModel):
    """The whole YAML file."""

    model_config = ConfigDict(extra="forbid")
    name: str = "pipeline"
    run_dir: str | None = None
    seed: int = Field(0, description="the run's seed: dataset order, sampling and trainer randomness derive "
                      "from it (molt.runtime.seeds); `molt run --seed N`, `molt sweep` one run per seed")
    transport: Literal["ipc", "tcp"] = "ipc"
    host: str = Field("127.0.0.1", description="the interface tcp edges bind to (loopback unless set)")
    curve: bool = Field(True, description="tcp edges: CURVE authentication and encryption with per-run keys "
                        "(molt.runtime.curve); false = plaintext, which any peer reaching the ports can read and inject into")
    curve_keys: str | None = Field(None, description="JSON file of the CURVE keys to use (as RUN_DIR/keys/curve.json); "
                                   "None = generated for each run")
    ready_timeout_s: float = Field(120.0, gt=0)
    stop_timeout_s: float = Field(10.0, gt=0)
    watchdog_s: float | None = Field(900.0, gt=0, description="stop the run when no process has written a metric "
                                     "line for this long, reporting every process's stacks (a hung stage or "
                                     "engine, a stopped process); null = never")
    stop_when: StopWhen | None = Field(None, description="end the run once a metric reaches a value, e.g. "
                                       "{metric: evaluate/accuracy, at_least: 0.7}")
    keep_checkpoints: int | None = Field(2, ge=1, description="newest complete checkpoints kept; null = all")
    keep_best: str | None = Field(None, description="a metric key (e.g. evaluate/accuracy): the complete checkpoint "
                                  "whose trainer is at the step of its highest value is kept beside the newest")
    results: dict[str, str] = Field(default_factory=dict, description="summary.json 'results': name -> metric "
                                    "key (its latest value; counters summed; every value with its time in 'results_history'), "
                                    "e.g. accuracy: evaluate/accuracy")
    placement: PlacementSpec = Field(default_factory=PlacementSpec,  # type: ignore[arg-type]
                                     description="where the processes run (molt.runtime.placement): children of molt run, "
                                     "or Ray actors")
    requires: dict[str, str] = Field(default_factory=dict, description="models this pipeline starts from that "
                                     "another pipeline makes: model name -> that pipeline's YAML (relative to this "
                                     "file), run first when the cache lacks the model (molt.commands.run.make_required)")
    policy: PolicySpec = Field(default_factory=PolicySpec,  # type: ignore[arg-type]
                               description="what sampling and training agree on, stated once (molt.policy)")
    stages: dict[str, StageSpec]
    edges: list[EdgeConfig] = Field(default_factory=list)
