"""``molt replay``: a pipeline whose upstream is replaced by a recorded edge."""

from __future__ import annotations

import copy
import difflib
from pathlib import Path
from typing import Any

import click
import yaml

from molt.commands.run import SET, run_pipeline
from molt.config import apply_override, load_yaml
from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import edge_dirname as edge_dir


@click.command("replay")
@click.argument("recording", type=click.Path())
@click.argument("pipeline", type=click.Path(), required=False)
@click.option("--from-step", type=int, help="re-run the training side of the run directory "
              "RECORDING from its checkpoint at this optimizer step, fed its recorded trajectories")
@click.option("--into", help="the stage (or stage.port) the recording feeds; default: the "
              "recorded edge's consumer, read from the RUN_DIR/record/EDGE folder name")
@click.option("--run-dir", type=click.Path(),
              help="a new or empty folder (default: runs/NAME-replay-TIMESTAMP)")
@SET
def command(recording: str, pipeline: str | None, from_step: int | None, into: str | None,
            run_dir: str | None, overrides: tuple[str, ...]) -> int:
    """Re-run stages offline from a recorded edge.

    RECORDING (a .arrow file or RUN_DIR/record/EDGE) feeds PIPELINE's stage --into; with
    --from-step, RECORDING is a run directory.
    """
    if from_step is not None:
        pipe, folder = replay_from_step(Path(recording), from_step, overrides)
        return run_pipeline(pipe, run_dir, resume=folder)
    if pipeline is None:
        raise ValueError("molt replay RECORDING PIPELINE.yaml: the pipeline is missing; hint: or "
                         "replay a run directory with --from-step K")
    data = load_yaml(Path(pipeline))
    for item in overrides:
        apply_override(data, item, pipeline)
    into = into or recorded_consumer(recording)
    try:
        pipe = Pipeline.from_spec(replay_spec(data, recording, into, pipeline),
                                  source=f"{pipeline} (replay into {into})")
    except ValueError as e:
        raise ValueError(f"{e}\nhint: --into names the stage that consumed the recorded edge "
                         "(for record/A.out--B.in it is B)") from None
    return run_pipeline(pipe, run_dir)


def _stage(endpoint: str) -> str:
    return endpoint.split(".")[0]


def _upstream(stage: str, edges: list[tuple[str, str]]) -> set[str]:
    """The stages with a path to ``stage`` along ``(src, dst)`` edges, ``stage`` excluded."""
    found: set[str] = set()
    frontier = {stage}
    while frontier:
        frontier = {src for src, dst in edges if dst in frontier} - found - {stage}
        found |= frontier
    return found


def replay_spec(data: dict[str, Any], recording: str, into: str, source: str) -> dict[str, Any]:
    """A copy of a pipeline dict with everything upstream of ``into`` (``stage[.port]``) replaced
    by a replay source of ``recording``; the replayed edge is recorded again, to compare.

    Raises:
        ValueError: ``into`` names no stage of the pipeline.
    """
    data = copy.deepcopy(data)
    target, stages = _stage(into), sorted(data.get("stages", {}))
    if target not in stages:
        close = difflib.get_close_matches(target, stages, n=1)
        raise ValueError(f"{source}: --into {into!r}: no such stage" +
                         (f"; did you mean {close[0]!r}?" if close else f"; stages: {stages}"))
    edges = data.get("edges", [])
    upstream = _upstream(target, [(_stage(e["from"]), _stage(e["to"])) for e in edges
                                  if not e.get("feedback")])
    data["stages"] = {k: v for k, v in data["stages"].items() if k not in upstream}
    data["stages"]["replay"] = {"class": "stages.replay.ReplaySource",
                                "config": {"path": recording}}
    data["edges"] = [{"from": "replay", "to": into, "record": True},
                     *(e for e in edges if not {_stage(e["from"]), _stage(e["to"])} & upstream)]
    data["name"] = f"{data.get('name', 'pipeline')}-replay"
    data.pop("run_dir", None)
    data.pop("requires", None)  # a replay trains on what a run recorded, from the models it had
    return data


def recorded_consumer(recording: str) -> str:
    """The consumer of a recorded edge: ``RUN_DIR/record/shape.out--sink.in/...`` -> ``sink.in``.

    Raises:
        ValueError: the path holds no ``record/EDGE`` folder.
    """
    for name in reversed(Path(recording).resolve().parts):
        if "--" in name and not name.endswith(".arrow"):
            return name.split("--", 1)[1]
    raise ValueError(f"--into is needed: {recording!r} is not inside "
                     "RUN_DIR/record/PRODUCER.PORT--CONSUMER.PORT/")


def replay_from_step(run_dir: Path, step: int, overrides: tuple[str, ...]) -> tuple[Pipeline, Path]:
    """The pipeline re-running a run's training side from its oldest complete checkpoint at
    optimizer step ``step`` (returned too), fed the trajectories recorded after it, so step
    ``step`` repeats its loss; stages fed only by broadcast edges are left out.

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
    click.echo(f"replaying {edge.name} after {folder.name} (step {step})", err=True)
    return replay, folder


def _recorded_trajectory_edge(pipe: Pipeline, trainer: str, run_dir: Path) -> Any:
    """The recorded edge with ``token_ids`` upstream of ``trainer`` nearest the source."""
    upstream = _upstream(trainer, [(e.src, e.dst) for e in pipe.edges if not e.cfg.feedback])
    upstream.add(trainer)
    order = pipe.topo_order()
    edges = [e for e in pipe.edges if e.cfg.record and e.dst in upstream
             and e.schema is not None and "token_ids" in e.schema.names
             and (run_dir / "record" / edge_dir(e.name)).is_dir()]
    if not edges:
        raise ValueError(f"{run_dir}: no recorded trajectory edge before stage {trainer!r}; hint: "
                         "set record: true on the rollout's output edge")
    return min(edges, key=lambda e: order.index(e.dst))


def _without_broadcast_only(spec: dict[str, Any]) -> dict[str, Any]:
    """Without the stages fed only by broadcast edges (an evaluation), and those only they fed."""
    fed = {_stage(e["to"]) for e in spec["edges"]}
    while True:
        kinds: dict[str, list[str]] = {}
        for e in spec["edges"]:
            kinds.setdefault(_stage(e["to"]), []).append(e.get("kind", "stream"))
        gone = {s for s in fed & set(spec["stages"])
                if all(k == "broadcast" for k in kinds.get(s, ["broadcast"]))}
        if not gone:
            return spec
        spec["stages"] = {k: v for k, v in spec["stages"].items() if k not in gone}
        spec["edges"] = [e for e in spec["edges"]
                         if _stage(e["from"]) not in gone and _stage(e["to"]) not in gone]
