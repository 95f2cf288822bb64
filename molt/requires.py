"""Models a pipeline starts from that another pipeline makes (``requires:``), made on first use.

    # pipelines/vlm_moe.yaml
    requires: {shapes-vlm-moe-sft: sft.yaml}   # model name -> the pipeline that writes it (beside this file)

Before `molt run` starts a pipeline, `make_required` looks each required model up in the model
cache (molt.models.default_cache_dir). A missing one is made by running its pipeline to the end,
in ``RUN_DIR/requires/NAME`` (its own logs, metrics and summary), under a file lock in the cache,
so that runs starting together (a sweep's seeds) make it once and the others wait for it. The
required pipeline's own ``requires:`` are made first. It must write the model into the cache
under that name (a train stage's ``export_model: NAME``). Once there, the model is reused by
every later run; delete its cache folder to make it again.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING, Any

from molt.metrics import get_logger

if TYPE_CHECKING:
    from molt.pipeline import Pipeline

log = get_logger("runner")


def beside(data: dict[str, Any], path: Path) -> None:
    """Make the pipeline files of ``data["requires"]`` (a pipeline YAML's, in place) absolute paths
    from the folder of ``path``, that YAML (not from where ``molt run`` starts): a run's resolved
    ``pipeline.yaml``, which its processes load, names the same files."""
    if isinstance(data.get("requires"), dict):
        data["requires"] = {k: str((path.parent / v).resolve()) if isinstance(v, str) else v
                            for k, v in data["requires"].items()}


def check_requires(requires: dict[str, str], source: str) -> None:
    """Raises ValueError naming ``requires.NAME`` unless NAME is a model name and its file exists."""
    for name, file in requires.items():
        if "/" in name or not Path(file).is_file():
            raise ValueError(f"{source}: requires.{name}: a model name (no '/') and an existing pipeline file; "
                             f"got {name!r}: {file!r}; hint: requires: {{MODEL_NAME: other_pipeline.yaml}}")


def make_required(pipe: Pipeline, run_dir: Path) -> int:
    """Make every model of ``pipe.spec.requires`` that the cache lacks (module docstring);
    returns 0, or the exit code of the required run that did not finish (130: interrupted).

    Raises:
        ValueError: a required pipeline finished without writing its model, naming the key.
    """
    from filelock import FileLock

    from molt.models import default_cache_dir
    from molt.pipeline import Pipeline
    from molt.runner import Runner

    cache = default_cache_dir()
    for name, source in pipe.spec.requires.items():
        made = cache / name / "config.json"
        if made.is_file():
            continue
        cache.mkdir(parents=True, exist_ok=True)
        with FileLock(cache / f".lock-{name}"):
            if made.is_file():  # made by another run while this one waited
                continue
            required, where = Pipeline.from_yaml(source), Path(run_dir) / "requires" / name
            if where.exists():
                log.warning("removing the unfinished run that was making %s: %s", name, where)
                shutil.rmtree(where)
            log.info("%s requires the model %s, which %s makes: running it first in %s", pipe.source, name,
                     source, where)
            if (code := make_required(required, where) or Runner(required, where).run()) != 0:
                log.error("the run making %s (requires.%s: %s) ended with exit code %d: %s", name, name, source,
                          code, where)
                return code
            if not made.is_file():
                raise ValueError(f"{pipe.source}: requires.{name}: {source} finished without writing the model "
                                 f"{name!r} into {cache}; hint: its train stage's export_model must be {name!r}")
            log.info("model %s made: %s", name, made.parent)
    return 0
