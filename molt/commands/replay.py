"""What ``molt replay`` runs: a pipeline whose upstream is replaced by a recorded edge.

``molt replay RECORDING PIPELINE.yaml [--into STAGE[.PORT]]`` feeds a recording into a pipeline's stage
(`replay_spec`); ``molt replay RUN_DIR --from-step K`` re-runs a run's training side from its checkpoint at
step K, fed the trajectories it recorded after it (`replay_from_step`).
"""

from __future__ import annotations

import copy
import difflib
import sys
from pathlib import Path
from typing import Any

import yaml

from molt.config import apply_override
from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import edge_dirname as edge_dir


def replay_spec(data: dict[str, Any], recording: str, into: str, source: str) -> dict[str, Any]:
    """A copy of a pipeline dict where everything upstream of ``into`` is replaced by
    a replay source re-emitting ``recording`` into that stage (or ``stage.port``);
    the replayed edge is recorded again, so the two recordings can be compared.

    Raises:
        ValueError: ``into`` names no stage of the pipeline.
    """
    data = copy.deepcopy(data)
    target, stages = into.split(".")[0], sorted(data.get("stages", {}))
    if target not in stages:
        close = difflib.get_close_matches(target, stages, n=1)
        raise ValueError(f"{source}: --into {into!r}: no such stage" +
                         (f"; did you mean {close[0]!r}?" if close else f"; stages: {stages}"))
    edges = data.get("edges", [])
    upstream: set[str] = set()
    frontier = {target}
    while frontier:
        frontier = {e["from"].split(".")[0] for e in edges
                    if e["to"].split(".")[0] in frontier and not e.get("feedback")} - upstream - {target}
        upstream |= frontier
    data["stages"] = {k: v for k, v in data["stages"].items() if k not in upstream}
    data["stages"]["replay"] = {"class": "stages.replay.ReplaySource", "config": {"path": recording}}
    kept = [e for e in edges if e["from"].split(".")[0] not in upstream and e["to"].split(".")[0] not in upstream]
    data["edges"] = [{"from": "replay", "to": into, "record": True}, *kept]
    data["name"] = f"{data.get('name', 'pipeline')}-replay"
    data.pop("run_dir", None)
    data.pop("requires", None)  # a replay trains on what a run recorded, from the models that run had
    return data


def recorded_consumer(recording: str) -> str:
    """``stage.port`` that consumed a recorded edge, from its folder name
    (``RUN_DIR/record/shape.out--sink.in/...`` -> ``sink.in``).

    Raises:
        ValueError: the path holds no ``record/EDGE`` folder.
    """
    parts = Path(recording).resolve().parts
    for name in reversed(parts):
        if "--" in name and not name.endswith(".arrow"):
            return name.split("--", 1)[1]
    raise ValueError(f"--into is needed: {recording!r} is not inside RUN_DIR/record/PRODUCER.PORT--CONSUMER.PORT/")


def replay_from_step(run_dir: Path, step: int, overrides: list[str]) -> tuple[Pipeline, Path]:
    """The pipeline that re-runs a run's training side from the checkpoint at optimizer step ``step``,
    and that checkpoint's folder (the new run's stages restore from it).

    Takes ``RUN_DIR/pipeline.yaml``, the oldest complete checkpoint whose trainer was
    at ``step``, and the run's earliest recorded trajectory edge upstream of the
    trainer; that edge's consumer and every stage after it restore from the checkpoint
    and are fed the batches recorded after it (the checkpoint's per-edge counts), so
    step ``step`` sees the same rows in the same order and repeats its recorded loss.
    Stages fed only by broadcast edges (an evaluation) are left out.

    Raises:
        ValueError: no such checkpoint, or no recorded trajectory edge before the trainer.
    """
    from molt.runtime.checkpoint import checkpoint_at_version, read_replica_state, replica_names

    source = str(run_dir / "pipeline.yaml")
    data = yaml.safe_load(Path(source).read_text())
    for item in overrides:
        apply_override(data, item, source)
    pipe = Pipeline.from_spec(data, source=source)
    names = replica_names(pipe.checkpointed())
    folder, trainer = checkpoint_at_version(run_dir, names, step)
    edge = _recorded_trajectory_edge(pipe, trainer, run_dir)
    skip = {f"{name}.arrow": read_replica_state(folder, name)["recorded"].get(edge.name, 0)
            for name in sorted(names) if name.rsplit(".", 1)[0] == edge.src}
    spec = _without_broadcast_only(replay_spec(data, str(run_dir / "record" / edge_dir(edge.name)),
                                               f"{edge.dst}.{edge.dst_port}", source))
    spec["stages"]["replay"]["config"]["skip"] = skip
    replay = Pipeline.from_spec(spec, source=f"{source} (replay from step {step})")
    print(f"replaying {edge.name} after {folder.name} (step {step})", file=sys.stderr)
    return replay, folder


def _recorded_trajectory_edge(pipe: Pipeline, trainer: str, run_dir: Path) -> Any:
    """The recorded edge carrying ``token_ids`` nearest the source, upstream of ``trainer``."""
    upstream, frontier = {trainer}, {trainer}
    while frontier:
        frontier = {e.src for e in pipe.edges if e.dst in frontier and not e.cfg.feedback} - upstream
        upstream |= frontier
    order = pipe.topo_order()
    edges = [e for e in pipe.edges if e.cfg.record and e.dst in upstream and e.schema is not None
             and "token_ids" in e.schema.names and (run_dir / "record" / edge_dir(e.name)).is_dir()]
    if not edges:
        raise ValueError(f"{run_dir}: no recorded trajectory edge before stage {trainer!r}; hint: set record: "
                         "true on the rollout's output edge")
    return min(edges, key=lambda e: order.index(e.dst))


def _without_broadcast_only(spec: dict[str, Any]) -> dict[str, Any]:
    """Drop stages fed only by broadcast edges (an evaluation) and the stages only they feed (the
    trainer's weights outputs, then unsubscribed, publish nothing)."""
    fed = {e["to"].split(".")[0] for e in spec["edges"]}
    while True:
        kinds: dict[str, list[str]] = {}
        for e in spec["edges"]:
            kinds.setdefault(e["to"].split(".")[0], []).append(e.get("kind", "stream"))
        gone = {s for s in fed & set(spec["stages"]) if all(k == "broadcast" for k in kinds.get(s, ["broadcast"]))}
        if not gone:
            break
        spec["stages"] = {k: v for k, v in spec["stages"].items() if k not in gone}
        spec["edges"] = [e for e in spec["edges"]
                         if e["from"].split(".")[0] not in gone and e["to"].split(".")[0] not in gone]
    return spec
