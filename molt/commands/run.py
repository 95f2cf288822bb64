"""`molt run`: a pipeline's run, after the models it requires."""

from __future__ import annotations

import shutil
from pathlib import Path

from molt.runtime.metrics import get_logger
from molt.runtime.pipeline import Pipeline
from molt.runtime.runner import Runner

log = get_logger("runner")


def make_required(pipe: Pipeline, run_dir: Path) -> int:
    """Make every model of ``pipe.spec.requires`` that the cache lacks; returns 0, or the exit code
    of the required run that did not finish (130: interrupted).

        requires: {shapes-vlm-moe-sft: sft.yaml}   # model name -> the pipeline that writes it (beside this file)

    A required model missing from the model cache (molt.models.default_cache_dir) is made by running its
    pipeline to the end (its own ``requires:`` first) in ``RUN_DIR/requires/NAME``, under a file lock in
    the cache, so that runs starting together (a sweep's seeds) make it once. The pipeline must write the
    model under that name (a train stage's ``export_model: NAME``); delete its cache folder to remake it.

    Raises:
        ValueError: a required pipeline finished without writing its model, naming the key.
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
