"""The ``molt`` command: run, sweep, compare, eval, export, graph, replay, inspect, plot, models.

``molt run PIPELINE.yaml [--set key=value ...] [--seed N] [--run-dir DIR | --resume RUN_DIR]``
``molt sweep PIPELINE.yaml --seeds N [--set ...] [--out DIR] [--threshold KEY=VALUE [--lower-bound]]``
``molt compare A B --metric NAME [--margin M]``
``molt eval RUN_DIR | MODEL [--version V] [--task T ...] [--samples K [--temperature T]] [--num-problems N]``
``molt export RUN_DIR OUT [--version V]``
``molt graph PIPELINE.yaml [--resolved]``
``molt replay RECORDING PIPELINE.yaml [--into STAGE[.PORT]] [--set ...]``
``molt replay RUN_DIR --from-step K [--set ...]``
``molt inspect FILE.arrow [--tokenizer MODEL] [--samples N]``
``molt plot RUN_DIR | SWEEP_DIR [SWEEP_DIR ...]``
``molt models prepare NAME``
``molt models upcycle SOURCE OUT [--experts E] [--top-k K] [--seed S]``
``molt models vlm SOURCE OUT [--image-size PX] [--patch-size PX] [--vision-hidden H] [--vision-layers N]
[--vision-tower CLIP]``
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import yaml

from molt.config import apply_override, differing_keys, load_yaml
from molt.runtime.pipeline import Pipeline
from molt.runtime.placement import catch_stop_signals


def cmd_run(args: argparse.Namespace) -> int:
    """Validate and run a pipeline; exit code 0 on a clean drain."""
    pipe = Pipeline.from_yaml(args.pipeline, args.set + ([] if args.seed is None else [f"seed={args.seed}"]))
    if args.resume and args.run_dir:
        raise ValueError("--resume RUN_DIR continues in RUN_DIR; got --run-dir too; hint: pass only --resume")
    if args.resume and (saved := Path(args.resume, "pipeline.yaml")).is_file():  # the run goes on as it started
        if (seed := (was := yaml.safe_load(saved.read_text()) or {}).get("seed", 0)) != pipe.spec.seed:
            raise ValueError(f"--resume {args.resume}: the run has seed {seed}; got {pipe.spec.seed}; hint: --seed {seed}")
        if keys := differing_keys(was, yaml.safe_load(yaml.safe_dump(pipe.to_dict(), sort_keys=False))):
            raise ValueError(f"--resume {args.resume}: the pipeline differs from the run's ({saved}) at "
                             f"{', '.join(keys[:4])}; hint: the file and --set values it started with, or "
                             f"molt run {saved} --resume {args.resume}")
    return _run(pipe, args.resume or args.run_dir, resume=bool(args.resume))


def check_torchvision() -> None:
    """Refuse to start when an installed torchvision cannot be imported beside this torch.

    PyPI's torchvision (which `pip install -e '.[cpu]'` brings back beside the CPU torch) fails
    with "operator torchvision::nms does not exist", and transformers then fails in every stage
    with "Could not import module 'LlamaConfig'", hiding the cause. Costs one import of
    torchvision (about a second) where it is installed, nothing where it is not.

    Raises:
        ValueError: torchvision is installed and does not import, with the command that fixes it.
    """
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever breaks it, transformers would break the same way
        raise ValueError(f"torchvision is installed but does not import beside torch: {type(e).__name__}: {e}; "
                         "every stage would fail in transformers (\"Could not import module 'LlamaConfig'\"); "
                         "hint: pip uninstall -y torchvision torchaudio torchcodec (Molt needs none of them)") from e


def _run(pipe: Pipeline, run_dir: str | None, resume: bool | Path = False) -> int:
    """Run ``pipe`` in ``run_dir`` (new or empty unless ``resume`` is True; a checkpoint
    folder as ``resume`` restores a new run's stages from it)."""
    from molt.commands.run import make_required
    from molt.runtime.runner import Runner, default_run_dir

    check_torchvision()
    pipe.preflight()
    path = Path(run_dir) if run_dir else default_run_dir(pipe)
    if resume is True and not (path / "pipeline.yaml").is_file():
        raise ValueError(f"--resume {str(path)!r}: not a run directory (no pipeline.yaml)")
    if resume is not True and path.exists() and any(path.iterdir()):
        raise ValueError(f"run dir {str(path)!r} is not empty; hint: pass another --run-dir, "
                         "or --resume it to continue from its last checkpoint")
    catch_stop_signals()
    return make_required(pipe, path) or Runner(pipe, path, resume=resume).run()


def cmd_sweep(args: argparse.Namespace) -> int:
    """Run a pipeline once per seed and summarise the seeds (molt.commands.sweep)."""
    from molt.commands.sweep import Sweep, Threshold

    if args.lower_bound and not args.threshold:
        raise ValueError("--lower-bound applies to --threshold; got no --threshold; hint: --threshold KEY=VALUE")
    threshold = Threshold.parse(args.threshold, args.lower_bound) if args.threshold else None
    check_torchvision()
    sweep = Sweep(args.pipeline, args.set, Path(args.out or f"runs/{Path(args.pipeline).stem}-sweep"), args.seeds,
                  threshold)
    catch_stop_signals()
    code = sweep.run()
    print(sweep.out / "sweep.json")
    return code


def cmd_compare(args: argparse.Namespace) -> int:
    """Compare two arms of runs on one metric (molt.commands.stats.compare); prints the verdict."""
    from molt.commands.stats import compare
    from molt.commands.sweep import arm_values

    a, b = arm_values(args.a, args.metric), arm_values(args.b, args.metric)
    result = compare(list(a.values()), list(b.values()), args.metric, args.margin, args.confidence)
    for label, arm, runs in (("A", args.a, a), ("B", args.b, b)):
        print(f"{label} = {arm}" + ("" if "," in arm else f" ({', '.join(runs)})"))
    print(result.describe())
    if args.json:
        Path(args.json).write_text(json.dumps(result.to_dict(), indent=1))
    return 0


def cmd_eval(args: argparse.Namespace) -> int:
    """Evaluate a model, or a run at a policy version, on one or several tasks (molt.commands.eval)."""
    from molt.commands.eval import describe, eval_report

    report = eval_report(args.target, args.version, args.task, args.samples, args.temperature, args.num_problems,
                         args.engine, args.seed)
    print(describe(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    """Write a run's trained policy at a version as a Hugging Face folder (molt.commands.export)."""
    from molt.commands.export import export_run

    out, version = export_run(Path(args.run_dir), args.version, Path(args.out))
    print(f"{out} (policy version {version} of {args.run_dir})")
    return 0


def cmd_graph(args: argparse.Namespace) -> int:
    pipe = Pipeline.from_yaml(args.pipeline, args.set)
    print(yaml.safe_dump(pipe.to_dict(), sort_keys=False) if args.resolved else pipe.describe())
    return 0


def cmd_replay(args: argparse.Namespace) -> int:
    from molt.commands.replay import recorded_consumer, replay_from_step, replay_spec

    if args.from_step is not None:
        pipe, folder = replay_from_step(Path(args.recording), args.from_step, args.set)
        return _run(pipe, args.run_dir, resume=folder)
    if args.pipeline is None:
        raise ValueError("molt replay RECORDING PIPELINE.yaml: the pipeline is missing; hint: or replay a run "
                         "directory with --from-step K")
    data = load_yaml(Path(args.pipeline))
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
    from molt.runtime.recording import summarize

    tokenizer = None
    if args.tokenizer:
        from transformers import AutoTokenizer

        from molt.models import resolve_model

        tokenizer = AutoTokenizer.from_pretrained(resolve_model(args.tokenizer))
    print(summarize(args.file, tokenizer, args.samples))
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from molt.commands.plot import plot_run, plot_sweeps

    dirs = [Path(d) for d in args.run_dir]
    for path in plot_sweeps(dirs) if (dirs[0] / "sweep.json").is_file() or len(dirs) > 1 else plot_run(dirs[0]):
        print(path)
    return 0


def cmd_models(args: argparse.Namespace) -> int:
    from molt.models import prepare, resolve_model

    if args.models_command == "upcycle":
        from molt.models.upcycle import upcycle

        print(upcycle(resolve_model(args.source), Path(args.out), args.experts, args.top_k, args.seed))
        return 0
    if args.models_command == "vlm":
        from molt.models.vlm import build_vlm

        tower = resolve_model(args.vision_tower) if args.vision_tower else None
        print(build_vlm(resolve_model(args.source), Path(args.out), args.image_size, args.patch_size,
                        args.vision_hidden, args.vision_layers, args.seed, tower))
        return 0
    print(prepare(args.name))
    return 0


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="molt", description="Asynchronous RL of language models as a DAG of stages.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a pipeline")
    run.add_argument("pipeline", help="a pipeline YAML file, e.g. pipelines/smoke.yaml")
    run.add_argument("--run-dir", help="a new or empty folder for the run (default: runs/NAME-TIMESTAMP)")
    run.add_argument("--resume", metavar="RUN_DIR", help="continue a stopped run from its newest complete "
                     "checkpoint (same pipeline and --set values)")
    run.add_argument("--seed", type=int, help="the run's seed (as --set seed=N; molt.runtime.seeds)")
    _eval_commands(sub)
    sweep = _statistics_commands(sub)
    graph = sub.add_parser("graph", help="print the validated DAG")
    graph.add_argument("pipeline", help="a pipeline YAML file")
    graph.add_argument("--resolved", action="store_true", help="print the pipeline as it loads: its base merged, "
                       "the policy: block's facts stated once (a run's pipeline.yaml)")
    replay = sub.add_parser("replay", help="re-run stages offline from a recorded edge")
    replay.add_argument("recording", help="a recorded .arrow file or folder (RUN_DIR/record/EDGE); with "
                        "--from-step, a run directory")
    replay.add_argument("pipeline", nargs="?", help="the pipeline whose downstream stages re-run")
    replay.add_argument("--from-step", type=int, help="re-run the training side of the run directory from "
                        "its checkpoint at this optimizer step, fed its recorded trajectories")
    replay.add_argument("--into", help="the stage (or stage.port) the recording feeds; default: the recorded "
                        "edge's consumer, read from the RUN_DIR/record/EDGE folder name")
    replay.add_argument("--run-dir", help="a new or empty folder (default: runs/NAME-replay-TIMESTAMP)")
    for sp in (run, graph, replay, sweep):
        sp.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a YAML value, e.g. stages.source.config.num_groups=4")
    insp = sub.add_parser("inspect", help="summarise a recorded Arrow file")
    insp.add_argument("file")
    insp.add_argument("--tokenizer", help="a model folder or name whose tokenizer decodes token_ids")
    insp.add_argument("--samples", type=int, default=1)
    plot = sub.add_parser("plot", help="write PNG curves of a run into RUN_DIR/plots/, of a sweep (mean, "
                          "interval, every seed), or of two sweeps overlaid")
    plot.add_argument("run_dir", nargs="+", help="a run folder, a sweep folder, or two sweep folders")
    models = sub.add_parser("models", help="model utilities")
    msub = models.add_subparsers(dest="models_command", required=True)
    prep = msub.add_parser("prepare", help="convert a model into a local Hugging Face folder")
    prep.add_argument("name", nargs="?", default="smollm2-135m-instruct")
    up = msub.add_parser("upcycle", help="turn a dense Llama-style model into a Mixtral-style MoE with the same "
                         "logits (each MLP copied into every expert, a fresh router)")
    up.add_argument("source", help="a dense model: folder, hub id or smollm2-135m-instruct")
    up.add_argument("out", help="the new folder to write")
    up.add_argument("--experts", type=int, default=4, help="experts per layer (E)")
    up.add_argument("--top-k", type=int, default=2, help="experts per token (k)")
    up.add_argument("--seed", type=int, default=0, help="seed of the router initialisation")
    vlm = msub.add_parser("vlm", help="make a text model (dense or MoE) a LLaVA-style vision-language model with "
                          "a fresh CLIP vision tower and projector (molt.models.vlm)")
    vlm.add_argument("source", help="a Llama/Mistral/Mixtral model: folder, hub id or built-in name")
    vlm.add_argument("out", help="the new folder to write")
    vlm.add_argument("--image-size", type=int, default=64, help="side of the processed image (px)")
    vlm.add_argument("--patch-size", type=int, default=16, help="side of a vision patch (px)")
    vlm.add_argument("--vision-hidden", type=int, default=256, help="width of the vision tower")
    vlm.add_argument("--vision-layers", type=int, default=4, help="layers of the vision tower")
    vlm.add_argument("--seed", type=int, default=0, help="seed of the vision tower and projector")
    vlm.add_argument("--vision-tower", help="a pretrained CLIP model (folder or hub id, e.g. "
                     "openai/clip-vit-large-patch14-336) instead of a fresh tower; the sizes are then its own")
    return p


def _eval_commands(sub: Any) -> None:
    """``molt eval`` and ``molt export``: a model or a run's checkpoint, evaluated or taken away."""
    ev = sub.add_parser("eval", help="evaluate a model or a run's checkpoint: accuracy, pass@k, avg@k, maj@k")
    ev.add_argument("target", help="a run directory (its checkpoints), a model folder or a built-in model name")
    ev.add_argument("--version", type=int, help="a run's policy version (a complete checkpoint; default: the newest)")
    ev.add_argument("--task", action="append", default=[], help="arithmetic, shapes, gsm8k, a pipeline file or a "
                    "YAML mapping, again for several (molt.commands.eval.parse_task); default: the run's evaluation")
    ev.add_argument("--samples", type=int, help="k samples per problem besides the greedy one (default: 1)")
    ev.add_argument("--temperature", type=float, help="of the samples (default: the policy's, else 1.0)")
    ev.add_argument("--num-problems", type=int, help="the first N problems of each task")
    ev.add_argument("--engine", choices=["vllm", "transformers"], help="default: the evaluation stage's, else vllm")
    ev.add_argument("--seed", type=int, default=0, help="the engine's sampling seed")
    ev.add_argument("--json", help="also write the report to this JSON file")
    export = sub.add_parser("export", help="write a run's trained policy as a Hugging Face folder")
    export.add_argument("run_dir", help="a run directory")
    export.add_argument("out", help="the new folder to write")
    export.add_argument("--version", type=int, help="a policy version (a complete checkpoint; default: the newest)")


def _statistics_commands(sub: Any) -> argparse.ArgumentParser:
    """``molt sweep`` and ``molt compare``; returns the sweep's parser (it takes --set too)."""
    sweep = sub.add_parser("sweep", help="run a pipeline once per seed; sweep.json: means and 95%% intervals")
    sweep.add_argument("pipeline", help="a pipeline YAML file")
    sweep.add_argument("--seeds", type=int, required=True, help="seeds 0 .. N-1, one run each")
    sweep.add_argument("--out", help="the sweep's folder (default: runs/PIPELINE-sweep); again: resume it")
    sweep.add_argument("--threshold", metavar="KEY=VALUE", help="time to threshold per seed, e.g. "
                       "evaluate/accuracy=0.7")
    sweep.add_argument("--lower-bound", action="store_true", help="the threshold is reached when the value minus "
                       "its KEY_stderr reaches it")
    comp = sub.add_parser("compare", help="compare two sweeps (or run lists) on one metric: difference, "
                          "equivalence, verdict")
    comp.add_argument("a", help="arm A: a sweep folder, run folders joined by commas, or a JSON file of runs")
    comp.add_argument("b", help="arm B, the same forms")
    comp.add_argument("--metric", required=True, help="a results: name (e.g. accuracy_final) or a metric key")
    comp.add_argument("--margin", type=float, help="equivalence margin, in the metric's unit (e.g. 0.05)")
    comp.add_argument("--confidence", type=float, default=0.95, help="of the intervals; tests at 1 - this")
    comp.add_argument("--json", help="also write the comparison to this JSON file")
    return sweep


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if os.getcwd() not in sys.path:  # custom stages and envs by import path from here, as the runner's processes
        sys.path.insert(0, os.getcwd())
    handlers = {"run": cmd_run, "sweep": cmd_sweep, "compare": cmd_compare, "eval": cmd_eval, "export": cmd_export,
                "graph": cmd_graph, "replay": cmd_replay, "inspect": cmd_inspect, "plot": cmd_plot, "models": cmd_models}
    try:
        return handlers[args.command](args)
    except ValueError as e:
        print(f"molt: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # outside a run (a run stops its processes and returns 130 itself)
        print("molt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
