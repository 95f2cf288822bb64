"""The ``molt`` command: run, graph, replay, inspect, models.

``molt run PIPELINE.yaml [--set key=value ...] [--run-dir DIR]``
``molt graph PIPELINE.yaml``
``molt replay RECORDING PIPELINE.yaml [--into STAGE[.PORT]] [--set ...]``
``molt inspect FILE.arrow [--tokenizer MODEL] [--samples N]``
``molt models prepare NAME``
"""

from __future__ import annotations

import argparse
import copy
import difflib
import signal
import sys
from pathlib import Path
from typing import Any, NoReturn

import yaml

from molt.config import apply_override
from molt.pipeline import Pipeline


def _interrupt(*_: Any) -> NoReturn:
    raise KeyboardInterrupt


def cmd_run(args: argparse.Namespace) -> int:
    """Validate and run a pipeline; exit code 0 on a clean drain."""
    pipe = Pipeline.from_yaml(args.pipeline, args.set)
    return _run(pipe, args.run_dir)


def _run(pipe: Pipeline, run_dir: str | None) -> int:
    from molt.runner import Runner, default_run_dir

    path = Path(run_dir) if run_dir else default_run_dir(pipe)
    if path.exists() and any(path.iterdir()):
        raise ValueError(f"run dir {str(path)!r} is not empty; hint: pass another --run-dir")
    signal.signal(signal.SIGTERM, _interrupt)
    return Runner(pipe, path).run()


def cmd_graph(args: argparse.Namespace) -> int:
    print(Pipeline.from_yaml(args.pipeline, args.set).describe())
    return 0


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


def cmd_replay(args: argparse.Namespace) -> int:
    data = yaml.safe_load(Path(args.pipeline).read_text())
    for item in args.set:
        apply_override(data, item, args.pipeline)
    into = args.into or recorded_consumer(args.recording)
    try:
        pipe = Pipeline.from_spec(replay_spec(data, args.recording, into, args.pipeline),
                                  source=f"{args.pipeline} (replay into {into})")
    except ValueError as e:
        raise ValueError(f"{e}\nhint: --into names the stage that consumed the recorded edge "
                         "(for record/A.out--B.in it is B)") from None
    return _run(pipe, args.run_dir)


def cmd_inspect(args: argparse.Namespace) -> int:
    from molt.recording import summarize

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        from molt.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    print(summarize(args.file, tokenizer, args.samples))
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from molt.models import prepare

    print(prepare(args.name))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="molt", description="Asynchronous RL of language models as a DAG of stages.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline")
    run.add_argument("pipeline", help="a pipeline YAML file, e.g. pipelines/smoke.yaml")
    run.add_argument("--run-dir", help="a new or empty folder for the run (default: runs/NAME-TIMESTAMP)")
    graph = sub.add_parser("graph", help="print the validated DAG")
    graph.add_argument("pipeline", help="a pipeline YAML file")
    replay = sub.add_parser("replay", help="re-run stages offline from a recorded edge")
    replay.add_argument("recording", help="a recorded .arrow file or folder (RUN_DIR/record/EDGE)")
    replay.add_argument("pipeline", help="the pipeline whose downstream stages re-run")
    replay.add_argument("--into", help="the stage (or stage.port) the recording feeds; default: the recorded "
                        "edge's consumer, read from the RUN_DIR/record/EDGE folder name")
    replay.add_argument("--run-dir", help="a new or empty folder (default: runs/NAME-replay-TIMESTAMP)")
    for sp in (run, graph, replay):
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a YAML value, e.g. stages.source.config.num_groups=4")
    insp = sub.add_parser("inspect", help="summarise a recorded Arrow file")
    insp.add_argument("file")
    insp.add_argument("--tokenizer", help="a model folder or name whose tokenizer decodes token_ids")
    insp.add_argument("--samples", type=int, default=1)
    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert a model into a local Hugging Face folder")
    prep.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    handlers = {"run": cmd_run, "graph": cmd_graph, "replay": cmd_replay, "inspect": cmd_inspect,
                "models": cmd_models}
    try:
        return handlers[args.command](args)
    except ValueError as e:
        print(f"molt: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
