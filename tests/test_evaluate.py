"""The evaluate stage's weight files: only the newest hard link is kept (and the one being loaded)."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from molt.runtime.stage import StageContext
from stages.evaluate import Evaluate


def record(folder: Path, version: int) -> dict:
    path = folder / f"policy_v{version}.safetensors"
    path.write_bytes(b"x" * 10)
    return {"policy_version": version, "uri": f"file://{path}"}


def test_only_the_newest_link_and_the_one_being_loaded_are_kept(tmp_path, monkeypatch):
    broadcast, own = tmp_path / "broadcast", tmp_path / "eval"
    broadcast.mkdir(), own.mkdir()
    stage = Evaluate(Evaluate.Config.model_validate({"task": {"type": "arithmetic", "split": "eval",
                                                              "num_problems": 4}}), StageContext("evaluate"))
    stage.folder, stage.newest, stage.loading, stage.engine = own, None, None, SimpleNamespace(policy_version=0)
    for version in (1, 2, 3):  # arriving while an evaluation runs: each replaces the one before
        stage._keep(record(broadcast, version))
    assert sorted(p.name for p in own.iterdir()) == ["v3.safetensors"]

    loaded = []

    async def load(engine, rec):
        stage._keep(record(broadcast, 4))  # a newer version arrives while v3 loads: v3 stays until loaded
        loaded.append(sorted(p.name for p in own.iterdir()))

    async def evaluate(names):
        assert names == [""]

    monkeypatch.setattr("stages.evaluate.apply_weight_record", load)
    monkeypatch.setattr(stage, "evaluate", evaluate)
    asyncio.run(stage._load_and_evaluate({"policy_version": 3, "uri": f"file://{own / 'v3.safetensors'}"}, [""]))
    assert loaded == [["v3.safetensors", "v4.safetensors"]]
    assert sorted(p.name for p in own.iterdir()) == ["v4.safetensors"]
    pruned = stage._keep({"policy_version": 5, "uri": f"file://{broadcast / 'gone.safetensors'}"})
    assert pruned["uri"] is None and sorted(p.name for p in own.iterdir()) == ["v4.safetensors"]
    with pytest.raises(ValueError, match=r"stage 'evaluate': weight record v6 comes over 'nccl'; an evaluation "
                                         r"loads files; hint: .*transport \{type: shm\}"):
        stage._keep({"policy_version": 6, "uri": "nccl://127.0.0.1:29551?world_size=2", "format": "nccl"})
