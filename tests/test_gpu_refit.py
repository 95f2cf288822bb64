"""Refits through vLLM's weight-transfer API (molt.refit, molt.engines.nccl_transfer).

Four tiers:
- pure logic (config, record fields, rank layout, the digesting loader): fast, CPU;
- the trainer's sender against vLLM 0.32's own trainer engine, with the NCCL endpoint
  and broadcast stubbed (what vLLM would ship to the engines must equal what the
  record tells them): CPU, imports vLLM;
- the engine's side on a real VLLMEngine (vLLM's CPU build) with a file-backed backend
  (tests/doubles/file_transfer.py), through apply_weight_record as the rollout calls it: the
  whole AsyncLLM start/update/finish lifecycle, digests and probe, a corrupted refit caught
  (about 60 s on 2 busy cores: one engine start);
- `gpu`: one refit through NCCL from a trainer GPU to an engine GPU, verified.
  Unverified: not yet run on a GPU (no CUDA machine so far).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from molt.refit import (IPCTransport, NCCLTransport, ShmTransport, TransportConfig, check_covers, check_transport,
                        engine_backend, rank_offset, tensor_digest, tensor_layout, transfer_uri, update_info,
                        worker_init_info)

WHERE = "stages.train.config.publish.weights.transport"
PROBE = [1, 17, 300, 4211, 97, 5, 12000, 33, 2048, 7]


class Holder(BaseModel):
    """How a stage's Config would hold the transport."""

    model_config = {"extra": "forbid"}
    transport: TransportConfig = Field(default_factory=ShmTransport)


def nccl(**fields: Any) -> NCCLTransport:
    return NCCLTransport(type="nccl", **fields)


def small_state() -> dict[str, torch.Tensor]:
    return {"w": torch.arange(6, dtype=torch.float32).reshape(2, 3), "b": torch.ones(3, dtype=torch.bfloat16)}


def record_of(state: dict[str, torch.Tensor], version: int, **fields: Any) -> dict[str, Any]:
    """A weight-version record's transfer columns for ``state`` (digests as the trainer computes them)."""
    return {"policy_version": version, "tensor_names": list(state),
            "tensor_digests": [tensor_digest(t) for t in state.values()], **tensor_layout(state), **fields}


def sent(record: dict[str, Any]) -> dict[str, str]:
    return dict(zip(record["tensor_names"], record["tensor_digests"]))


# ---- pure logic ---------------------------------------------------------------------------------

def test_transport_defaults_to_shm_and_refuses_unknown_keys():
    assert Holder().transport.type == "shm"
    t = Holder.model_validate({"transport": {"type": "nccl"}}).transport
    assert isinstance(t, NCCLTransport) and (t.master_port, t.num_engine_workers, t.packed) == (29551, 1, True)
    with pytest.raises(ValidationError, match="master_prot"):
        Holder.model_validate({"transport": {"type": "nccl", "master_prot": 1}})
    with pytest.raises(ValidationError):
        Holder.model_validate({"transport": {"type": "rdma"}})


def test_nccl_without_cuda_is_refused_naming_the_yaml_key():
    check_transport(ShmTransport(), WHERE, cuda_available=False)
    with pytest.raises(ValueError, match=r"stages\.train\.config\.publish\.weights\.transport\.type: 'nccl' needs CUDA GPUs.*"
                                         r"\{type: shm\}"):
        check_transport(nccl(), WHERE, cuda_available=False)
    check_transport(nccl(), WHERE, cuda_available=True)
    with pytest.raises(ValueError, match=r"transport\.type: 'ipc' is not wired yet"):
        check_transport(IPCTransport(type="ipc"), WHERE, cuda_available=True)


def test_the_engine_side_needs_only_the_type_and_warns_about_the_rest(caplog):
    assert engine_backend(ShmTransport(), "stages.rollout.config.engine.transport") is None
    with caplog.at_level(logging.WARNING):
        assert engine_backend(nccl(), "x") == "nccl" and not caplog.records
        assert engine_backend(nccl(master_port=30000), "stages.rollout.config.engine.transport") == "nccl"
    assert "stages.rollout.config.engine.transport: master_port ignored" in caplog.text


def test_tensor_layout_lists_dtypes_and_shapes_in_state_order():
    assert tensor_layout(small_state()) == {"tensor_dtypes": ["float32", "bfloat16"], "tensor_shapes": [[2, 3], [3]]}


def test_update_info_comes_from_the_record_and_refuses_ragged_lists():
    record = record_of(small_state(), 3)
    assert update_info(record) == {"names": ["w", "b"], "dtype_names": ["float32", "bfloat16"],
                                   "shapes": [[2, 3], [3]]}
    with pytest.raises(ValueError, match="v3: tensor_names, tensor_dtypes and tensor_shapes differ.*2, 1, 2"):
        update_info({**record, "tensor_dtypes": ["float32"]})


def test_each_engine_joins_at_its_own_rank_from_the_records_uri():
    t = nccl(master_address="10.0.0.5", master_port=29600, num_engine_workers=4, buffer_mib=64)
    uri = transfer_uri(t)
    assert uri == "nccl://10.0.0.5:29600?world_size=5&packed=1&buffer_bytes=67108864&num_buffers=2"
    assert [rank_offset(r, 2) for r in (0, 1)] == [1, 3]  # replica 0: ranks 1-2, replica 1: ranks 3-4
    assert worker_init_info(uri, rank_offset(1, 2), 2) == {
        "master_address": "10.0.0.5", "master_port": 29600, "rank_offset": 3, "world_size": 5, "packed": True,
        "packed_buffer_size_bytes": 64 * 2**20, "packed_num_buffers": 2}
    with pytest.raises(ValueError, match="ranks 5..6 do not fit a group of 5.*num_engine_workers"):
        worker_init_info(uri, rank_offset(2, 2), 2)
    with pytest.raises(ValueError, match="uri must be nccl://"):
        worker_init_info("file:///dev/shm/policy_v1.safetensors", 1, 1)
    # 'auto': engines on other hosts reach the trainer at its host's routable address (Ray's choice too)
    auto = worker_init_info(transfer_uri(nccl(master_address="auto")), 1, 1)["master_address"]
    ray = pytest.importorskip("ray")
    assert auto == ray.util.get_node_ip_address() and auto != "auto"


def test_a_record_lacking_a_tensor_of_the_model_is_refused():
    record = record_of(small_state(), 2)
    check_covers({"w", "b"}, record)
    with pytest.raises(ValueError, match=r"v2 lacks 1 tensors of the model, e.g. \['lm_head.weight'\]"):
        check_covers({"w", "b", "lm_head.weight"}, record)


def test_the_watched_loader_digests_exactly_what_the_loader_consumes():
    from molt.engines.nccl_transfer import watching_loader

    state = small_state()
    consumed: list[str] = []

    def load(weights):  # a loader that stops after the first tensor
        for name, _ in weights:
            consumed.append(name)
            return {name}

    digests: dict[str, str] = {}
    assert watching_loader(load, digests, True)(list(state.items())) == {"w"}
    assert digests == {"w": tensor_digest(state["w"])} and consumed == ["w"]
    names: dict[str, str] = {}
    watching_loader(lambda ws: [n for n, _ in ws], names, False)(state.items())
    assert names == {"w": "", "b": ""}


def test_the_worker_extension_watches_the_transfer_target_and_restores_it():
    from molt.engines.nccl_transfer import MoltTransferWorkerExtension

    class Model(torch.nn.Module):
        def load_weights(self, weights):
            return {name for name, _ in weights}

    worker = MoltTransferWorkerExtension()
    with pytest.raises(RuntimeError, match="without weight_transfer_config"):
        worker.molt_watch_weights()
    model = Model()
    worker.weight_transfer_engine = SimpleNamespace(model=model)  # type: ignore[attr-defined]
    worker.molt_watch_weights(True)
    state = small_state()
    assert model.load_weights(list(state.items())) == {"w", "b"}  # what vLLM's NCCL engine calls
    result = worker.molt_unwatch_weights()
    assert result["digests"] == {n: tensor_digest(t) for n, t in state.items()}
    assert "load_weights" not in model.__dict__
    worker.molt_watch_weights(False)
    model.load_weights(list(state.items()))
    assert worker.molt_unwatch_weights()["digests"] == {}


# ---- the trainer's sender against vLLM's trainer engine (NCCL stubbed) ---------------------------

class CapturingClient:
    """What vLLM's trainer engine would have sent to the engines' control plane."""

    calls: list[tuple[str, Any]] = []

    def init_weight_transfer_engine(self, init_info):
        self.calls.append(("init", init_info))

    def start_weight_update(self):
        self.calls.append(("start", None))

    def update_weights(self, update_info):
        self.calls.append(("update", update_info))

    def finish_weight_update(self, weight_version=None):
        self.calls.append(("finish", weight_version))


@pytest.fixture
def stubbed_nccl(monkeypatch):
    """vLLM's NCCL trainer engine with its endpoint and broadcast stubbed; yields what it broadcast."""
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer import nccl_engine

    import molt.train.nccl_send as nt

    broadcast: list[tuple[str, torch.Tensor]] = []
    CapturingClient.calls = []
    monkeypatch.setattr(nt, "RecordDrivenClient", CapturingClient)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: SimpleNamespace(destroy=lambda: None))

    def fake_broadcast(self, source, meta):  # vLLM's own order/dtype/shape check, then "send"
        broadcast.extend((n, t.clone()) for n, t in self._checked_iter(source, meta))

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", fake_broadcast)
    return broadcast


def test_what_vllms_trainer_would_ship_equals_what_the_record_tells_the_engines(stubbed_nccl):
    from molt.train.nccl_send import NCCLSender

    t = nccl(master_port=29600, buffer_mib=8)
    sender = NCCLSender(t, device=torch.device("cpu"))
    state = small_state()
    record = record_of(state, 1, **sender.record_fields(state))
    sender.send(state)
    sender.send(state)  # the second version reuses the group: no second rendezvous
    kinds = [k for k, _ in CapturingClient.calls]
    assert kinds == ["init", "start", "update", "finish", "start", "update", "finish"]
    calls = dict(CapturingClient.calls)
    assert calls["init"] == worker_init_info(record["uri"], rank_offset(0, 1), 1)
    assert calls["update"] == update_info(record)
    assert [n for n, _ in stubbed_nccl] == ["w", "b", "w", "b"]
    assert all(torch.equal(sent_t, state[n]) for n, sent_t in stubbed_nccl)
    assert record["format"] == "nccl" and record["uri"].startswith("nccl://127.0.0.1:29600?world_size=2")


def test_a_send_no_engine_takes_times_out_and_a_failed_send_carries_its_error(stubbed_nccl, monkeypatch):
    from vllm.distributed.weight_transfer import nccl_engine

    from molt.train.nccl_send import NCCLSender

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", lambda s, src, m: time.sleep(3))
    with pytest.raises(RuntimeError, match=r"not taken within 0.3 s; the engines did not join"):
        NCCLSender(nccl(timeout_s=0.3), device=torch.device("cpu")).send(small_state())

    def broken(self, source, meta):
        raise ValueError("WeightSource metadata() disagrees")

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", broken)
    with pytest.raises(RuntimeError, match="failed on the trainer: ValueError") as info:
        NCCLSender(nccl(), device=torch.device("cpu")).send(small_state())
    assert isinstance(info.value.__cause__, ValueError)


def test_the_trainer_publishes_the_record_first_then_every_tensor_over_nccl(stubbed_nccl, monkeypatch,
                                                                             tiny_chat_model):
    """The trainer's nccl publication on CPU: CUDA check and device stubbed, vLLM's trainer engine real."""
    import functools

    import molt.train.nccl_send as nt
    import molt.train.publish as publish
    from molt.refit import state_digests
    from molt.train.model import full_state_dict, load_policy, shard_policy

    monkeypatch.setattr(publish, "check_transport", lambda transport, where: None)
    monkeypatch.setattr(nt.NCCLSender, "__init__", functools.partialmethod(nt.NCCLSender.__init__,
                                                                           device=torch.device("cpu")))
    model = shard_policy(load_policy(tiny_chat_model, temperature=1.0))
    config = publish.PublishConfig(probe_tokens=8, transport={"type": "nccl", "master_port": 29600})
    stage = publish.Publisher(config, model, 0, WHERE.removesuffix(".transport"))
    sent_records: list[tuple[dict[str, Any], int]] = []

    async def send(batch) -> None:  # what went out, and how many tensors NCCL had sent by then
        sent_records.append((batch.to_pylist()[0], len(stubbed_nccl)))

    assert stage.folder is None, "no weight files with nccl"
    asyncio.run(stage.publish(1, send))
    state = full_state_dict(model)
    (record, sent_before), = sent_records
    assert sent_before == 0, "the record precedes the tensors"
    assert (record["format"], record["policy_version"], len(record["probe_token_ids"])) == ("nccl", 1, 8)
    assert record["uri"].startswith("nccl://127.0.0.1:29600?world_size=2")
    assert dict(zip(record["tensor_names"], record["tensor_digests"])) == state_digests(state)
    assert update_info(record)["names"] == list(state) and record["tensor_shapes"][0] == list(next(iter(state.values())).shape)
    assert [n for n, _ in stubbed_nccl] == list(state), "every tensor sent, in the record's order"
    assert all(torch.equal(t, state[n]) for n, t in stubbed_nccl)
    stage.close()
    stage.close()  # idempotent


def test_the_records_init_and_update_info_are_accepted_by_vllms_dataclasses():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLWeightTransferInitInfo,
                                                              NCCLWeightTransferUpdateInfo)

    record = record_of(small_state(), 1, uri=transfer_uri(nccl(num_engine_workers=2)))
    init = NCCLWeightTransferInitInfo(**worker_init_info(record["uri"], 2, 1))
    assert (init.rank_offset, init.world_size, init.packed) == (2, 3, True)
    assert NCCLWeightTransferUpdateInfo(**update_info(record)).dtype_names == ["float32", "bfloat16"]


# ---- shared by the engine-side tests ------------------------------------------------------------

def trainer_logprobs(model, token_ids: list[int]) -> list[float]:
    device = next(model.parameters()).device
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([token_ids], device=device)).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(token_ids[1:], device=device)[:, None])[:, 0].tolist()


def step(model, seed: int) -> dict[str, torch.Tensor]:
    """A stand-in optimizer step: perturb every parameter; the HF-named state to export (tied head dropped)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn(p.shape, generator=generator).to(p.device, p.dtype))
    return {n: t.detach().clone() for n, t in model.state_dict().items() if n != "lm_head.weight"}


def max_diff(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) for x, y in zip(a, b))


# ---- the engine's receiver on vLLM's CPU build (file-backed backend) ------------------------------

@pytest.fixture(scope="module")
def small_llama(tiny_chat_model, tmp_path_factory):
    """A 2-layer random Llama with head_dim 64 (vLLM's CPU attention refuses tiny_chat_model's 8), tied head."""
    import shutil

    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("small_llama")
    for path in tiny_chat_model.iterdir():
        if not path.name.endswith((".safetensors", "config.json")) or path.name == "tokenizer_config.json":
            shutil.copy(path, folder / path.name)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                         eos_token_id=2, bos_token_id=1, pad_token_id=2, tie_word_embeddings=True)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder


def test_a_refit_through_vllms_transfer_lifecycle_is_digest_verified_probed_and_relabelled(small_llama, tmp_path):
    """VLLMEngine with a weight transfer and apply_weight_record, as the rollout stage calls them."""
    pytest.importorskip("vllm")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from molt.engines.base import SamplingParams
    from molt.engines.nccl_transfer import WeightTransfer
    from molt.engines.refit import apply_weight_record
    from molt.engines.vllm import VLLMEngine
    from molt.refit import Probe
    from molt.train.publish import publish_weights
    from tests.doubles.file_transfer import BACKEND, EXTENSION, FileReceiver

    model = AutoModelForCausalLM.from_pretrained(small_llama, dtype=torch.float32).eval()

    def streamed(version: int, seed: int) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """Version ``version``'s record as the trainer sends it (here the bytes lie in a file)."""
        state = step(model, seed)
        probe = Probe(PROBE, trainer_logprobs(model, PROBE), 1e-3)
        record = publish_weights(state, tmp_path / f"v{version}.safetensors", version, probe)
        return {**record, "format": BACKEND}, state

    async def main() -> None:
        engine = VLLMEngine(str(small_llama), max_model_len=256, kv_cache_gib=0.125,
                            weight_transfer=WeightTransfer(BACKEND, FileReceiver(digest=True), EXTENSION))
        try:
            before = await engine.prompt_logprobs(PROBE)
            assert max_diff(before, trainer_logprobs(model, PROBE)) < 1e-3
            # 1) a good refit: every tensor's digest as the loader consumed it, and the probe (tied head included)
            record, _ = streamed(1, seed=1)
            assert await apply_weight_record(engine, record) and engine.policy_version == 1
            assert engine.last_weight_digests == sent(record) and max_diff(engine.last_probe[1], before) > 1e-3
            # 2) later tokens carry the new version
            completion = await engine.generate("g", PROBE, SamplingParams(temperature=0.0, max_new_tokens=3))
            assert completion.policy_versions == [1, 1, 1]
            # 3) a streamed record is taken even when not newer (the trainer's send waits for it)
            assert await apply_weight_record(engine, record)
            # 4) a refit corrupted on the way (one tensor zeroed after the digests) is caught by name
            record2, state2 = streamed(2, seed=2)
            save_file({**state2, "model.norm.weight": torch.zeros_like(state2["model.norm.weight"])},
                      record2["uri"].removeprefix("file://"))
            with pytest.raises(RuntimeError, match=r"version 2 is not verified: 1 tensor\(s\) differ.*model\.norm"):
                await apply_weight_record(engine, record2)
            # 5) a record of another transfer, or one lacking a tensor of the model, is refused untouched
            with pytest.raises(ValueError, match=r"v3 comes over 'nccl', but this engine takes 'molt_test_file'"):
                await engine.receive_weights({**record, "policy_version": 3, "format": "nccl"})
            with pytest.raises(ValueError, match=r"v3 lacks 1 tensors of the model.*model\.norm\.weight"):
                await engine.receive_weights({**record, "policy_version": 3, "tensor_names":
                                              [n for n in record["tensor_names"] if n != "model.norm.weight"]})
            assert engine.policy_version == 2
        finally:
            engine.close()

    asyncio.run(main())


def test_an_engine_that_loads_files_refuses_a_streamed_record(tiny_chat_model):
    from molt.engines import EngineConfig, make_engine
    from molt.engines.hf import TransformersEngine
    from molt.engines.refit import apply_weight_record

    record = {**record_of(small_state(), 1, **{"format": "nccl", "uri": transfer_uri(nccl())}), "probe_token_ids": []}
    with pytest.raises(ValueError, match=r"v1 comes over 'nccl', but TransformersEngine loads files only"):
        asyncio.run(apply_weight_record(TransformersEngine(str(tiny_chat_model)), record))
    config = EngineConfig(type="transformers", transport={"type": "nccl"})
    with pytest.raises(ValueError, match=r"stages\.rollout\.config\.engine\.transport\.type: 'nccl' needs CUDA"):
        make_engine(config, str(tiny_chat_model), "stages.rollout.config.engine")


# ---- GPU: one refit through NCCL ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def publish(engine, sender, state: dict[str, torch.Tensor], sent_state: dict[str, torch.Tensor],
                  version: int, probe) -> None:
    """Version ``version`` as the trainer publishes it (record with the digests of ``state``),
    while the engine takes it as the rollout does: trainer and engine meet in NCCL; the trainer
    sends ``sent_state``."""
    from molt.engines.refit import apply_weight_record
    from molt.refit import state_digests, weight_record

    fields = sender.record_fields(state)
    record = weight_record(state, version, fields["uri"], state_digests(state), probe, fields["format"])
    await asyncio.gather(apply_weight_record(engine, record), asyncio.to_thread(sender.send, sent_state))


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL refuses two ranks on one GPU")
def test_one_nccl_refit_from_a_trainer_gpu_to_a_vllm_engine_gpu_is_verified(default_model_dir):
    """Unverified: not yet run on a GPU. Needs 2 CUDA devices and vLLM's GPU build: the
    trainer (this process) on cuda:1, the engine's worker on cuda:0 (NCCL refuses two
    ranks on one device). fp32 both sides; the probe tolerance is not yet calibrated on
    GPUs (if the build refuses fp32 attention, use bfloat16 and an atol near 1)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from molt.engines import EngineConfig, make_engine
    from molt.train.nccl_send import NCCLSender
    from molt.refit import Probe

    transport = nccl(master_port=free_port(), num_engine_workers=1, timeout_s=300)
    check_transport(transport, WHERE)
    device = torch.device("cuda", 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).to(device).eval()
    sender = NCCLSender(transport, device=device)

    async def main() -> None:
        engine = make_engine(EngineConfig(transport={"type": "nccl"}, max_model_len=256, kv_cache_gib=1.0),
                             str(default_model_dir), "stages.rollout.config.engine", replica=0)
        try:
            before = await engine.prompt_logprobs(PROBE)
            state = step(model, seed=1)
            await publish(engine, sender, state, state, 1, Probe(PROBE, trainer_logprobs(model, PROBE), 1e-2))
            assert engine.policy_version == 1 and max_diff(engine.last_probe[1], before) > 1e-3
            state2 = step(model, seed=2)  # corrupted in transit: digests of state2, bytes of another
            corrupted = {**state2, "model.norm.weight": torch.zeros_like(state2["model.norm.weight"])}
            with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
                await publish(engine, sender, state2, corrupted, 2, Probe(PROBE, trainer_logprobs(model, PROBE), 1e-2))
        finally:
            sender.close()
            engine.close()

    asyncio.run(main())
