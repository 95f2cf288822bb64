"""``molt run``: a pipeline's run, after the models it requires."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import click
import yaml
from pydantic import BaseModel

from molt.agents.evaluation import EvaluationConfig
from molt.config import differing_keys
from molt.runtime.metrics import get_logger
from molt.runtime.pipeline import Pipeline
from molt.runtime.placement import catch_stop_signals
from molt.runtime.runner import Runner, default_run_dir

log = get_logger("runner")
SET = click.option("--set", "overrides", multiple=True, metavar="KEY=VALUE",
                   help="override a YAML value, e.g. stages.source.config.num_groups=4; repeatable")


@click.command("run")
@click.argument("pipeline", type=click.Path())
@click.option("--run-dir", type=click.Path(),
              help="a new or empty folder for the run (default: runs/NAME-TIMESTAMP)")
@click.option("--resume", metavar="RUN_DIR", type=click.Path(), help="continue a stopped run from "
              "its newest complete checkpoint (same pipeline and --set values)")
@click.option("--seed", type=int, help="the run's seed (as --set seed=N; molt.runtime.seeds)")
@SET
def command(pipeline: str, run_dir: str | None, resume: str | None, seed: int | None,
            overrides: tuple[str, ...]) -> int:
    """Run a pipeline (YAML file); exit code 0 on a clean drain."""
    pipe = load_pipeline(pipeline, [*overrides, *([] if seed is None else [f"seed={seed}"])])
    if resume and run_dir:
        raise ValueError("--resume RUN_DIR continues in RUN_DIR; got --run-dir too; "
                         "hint: pass only --resume")
    if resume and (saved := Path(resume, "pipeline.yaml")).is_file():  # goes on as it started
        was = yaml.safe_load(saved.read_text()) or {}
        if (had := was.get("seed", 0)) != pipe.spec.seed:
            raise ValueError(f"--resume {resume}: the run has seed {had}; got {pipe.spec.seed}; "
                             f"hint: --seed {had}")
        now = yaml.safe_load(yaml.safe_dump(pipe.to_dict(), sort_keys=False))
        if keys := differing_keys(was, now):
            raise ValueError(f"--resume {resume}: the pipeline differs from the run's ({saved}) at "
                             f"{', '.join(keys[:4])}; hint: the file and --set values it started "
                             f"with, or molt run {saved} --resume {resume}")
    return run_pipeline(pipe, resume or run_dir, resume=bool(resume))


def load_pipeline(path: str | Path, overrides: list[str] | None = None) -> Pipeline:
    """`Pipeline.from_yaml`, then `refuse_shared_problems`; raises their ValueError."""
    pipe = Pipeline.from_yaml(path, overrides)
    refuse_shared_problems(pipe)
    return pipe


def _tasks(config: Any, where: str, held_out: bool = False) -> Iterator[tuple[str, Any, bool]]:
    """(YAML key, task config, in an evaluation) of each task in ``config``, at any depth."""
    if callable(getattr(config, "pool", None)):
        yield where, config, held_out
    elif isinstance(config, BaseModel | dict):
        held_out = held_out or isinstance(config, EvaluationConfig)
        items = (config.items() if isinstance(config, dict)
                 else ((k, getattr(config, k)) for k in type(config).model_fields))
        for key, value in items:
            yield from _tasks(value, f"{where}.{key}", held_out)


def refuse_shared_problems(pipe: Pipeline) -> None:
    """Refuse a pipeline whose evaluation's task draws from the ``pool()`` of another task.

    Raises:
        ValueError: naming both tasks' YAML keys.
    """
    found = [t for sid, n in pipe.stages.items() for t in _tasks(n.config, f"stages.{sid}.config")]
    trained = [(other, stream.pool()) for other, stream, held_out in found if not held_out]
    for where, task, _ in (t for t in found if t[2]):
        for other, pool in trained:
            if task.pool() == pool:
                raise ValueError(f"{pipe.source}: {where} and {other} both draw from {pool}: the "
                                 "evaluation could grade trained problems; hint: split: eval, or "
                                 "another file")


def check_torchvision() -> None:
    """Refuse to start beside a torchvision that does not import (PyPI's beside the CPU torch),
    which would fail transformers in every stage.

    Raises:
        ValueError: torchvision is installed and does not import, with the command that fixes it.
    """
    import importlib.util

    if importlib.util.find_spec("torchvision") is None:
        return
    try:
        import torchvision  # noqa: F401
    except Exception as e:  # noqa: BLE001 - whatever breaks it breaks transformers the same way
        raise ValueError(f"torchvision is installed but does not import beside torch: "
                         f"{type(e).__name__}: {e}; every stage would fail in transformers "
                         "(\"Could not import module 'LlamaConfig'\"); hint: pip uninstall -y "
                         "torchvision torchaudio torchcodec (Molt needs none of them)") from e


def run_pipeline(pipe: Pipeline, run_dir: str | None, resume: bool | Path = False) -> int:
    """Run ``pipe`` in ``run_dir`` (new or empty unless ``resume`` is True; a checkpoint
    folder as ``resume`` restores a new run's stages from it); returns the exit code.

    Raises:
        ValueError: ``run_dir`` is not empty, or not a run to resume.
    """
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


def make_required(pipe: Pipeline, run_dir: Path) -> int:
    """Make each model of ``pipe.spec.requires`` ({NAME: PIPELINE}) the cache lacks by running
    PIPELINE in ``RUN_DIR/requires/NAME`` under a file lock (a sweep's seeds make it once);
    returns 0, or the exit code of the run that did not finish.

    Raises:
        ValueError: a required pipeline finished without writing its model (``export_model``).
    """
    from filelock import FileLock

    from molt.models import default_cache_dir

    cache = default_cache_dir()
    for name, source in pipe.spec.requires.items():
        made = cache / name / "config.json"
        if made.is_file():
            continue
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(cache / f".lock-{name}"):
            if made.is_file():  # made by another run while this one waited
                continue
            required, where = load_pipeline(source), Path(run_dir) / "requires" / name
            if where.exists():
                log.warning("removing the unfinished run that was making %s: %s", name, where)
                shutil.rmtree(where)
            log.info("%s requires the model %s, which %s makes: running it first in %s",
                     pipe.source, name, source, where)
            if (code := make_required(required, where) or Runner(required, where).run()) != 0:
                log.error("the run making %s (requires.%s: %s) ended with exit code %d: %s",
                          name, name, source, code, where)
                return code
            if not made.is_file():
                raise ValueError(f"{pipe.source}: requires.{name}: {source} finished without "
                                 f"writing the model {name!r} into {cache}; hint: its train "
                                 f"stage's export_model must be {name!r}")
            log.info("model %s made: %s", name, made.parent)
    return 0
