"""Refits through vLLM's weight-transfer API (molt.engines.transport, molt.engines.nccl_transfer).

Four tiers:
- pure logic (config, record fields, rank layout, the digesting loader): fast, CPU;
- the trainer's sender against vLLM 0.32's own trainer engine, with the NCCL endpoint
  and broadcast stubbed (what vLLM would ship to the engines must equal what the
  record tells them): CPU, imports vLLM;
- the engine's receiver on a real vLLM CPU engine with a file-backed backend
  (tests/doubles/file_transfer.py): the whole AsyncLLM start/update/finish lifecycle,
  digests and probe, a corrupted refit caught (about 60 s on 2 busy cores: one engine start);
- `gpu`: one refit through NCCL from a trainer GPU to an engine GPU, verified.
  Unverified: not yet run on a GPU (no CUDA machine so far).
"""

from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Any

import pytest
import torch
from pydantic import BaseModel, Field, ValidationError

from molt.engines.transport import (IPCTransport, NCCLTransport, ShmTransport, TransportConfig, check_covers,
                                    check_transport, engine_backend, rank_offset, tensor_layout, transfer_uri,
                                    update_info, worker_init_info)
from molt.engines.weights import tensor_digest, verify_refit

WHERE = "stages.broadcast.config.transport"
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
    with pytest.raises(ValueError, match=r"stages\.broadcast\.config\.transport\.type: 'nccl' needs CUDA GPUs.*"
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
    from types import SimpleNamespace

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

    import molt.engines.nccl_transfer as nt

    broadcast: list[tuple[str, torch.Tensor]] = []
    CapturingClient.calls = []
    monkeypatch.setattr(nt, "RecordDrivenClient", CapturingClient)
    monkeypatch.setattr(nccl_engine, "open_trainer_endpoint", lambda info: "group")

    def fake_broadcast(self, source, meta):  # vLLM's own order/dtype/shape check, then "send"
        broadcast.extend((n, t.clone()) for n, t in self._checked_iter(source, meta))

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", fake_broadcast)
    return broadcast


def test_what_vllms_trainer_would_ship_equals_what_the_record_tells_the_engines(stubbed_nccl):
    from molt.engines.nccl_transfer import NCCLSender

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

    from molt.engines.nccl_transfer import NCCLSender

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", lambda s, src, m: time.sleep(3))
    with pytest.raises(RuntimeError, match=r"not taken within 0.3 s; the engines did not join"):
        NCCLSender(nccl(timeout_s=0.3), device=torch.device("cpu")).send(small_state())

    def broken(self, source, meta):
        raise ValueError("WeightSource metadata() disagrees")

    monkeypatch.setattr(nccl_engine.NCCLTrainerWeightTransferEngine, "_broadcast", broken)
    with pytest.raises(RuntimeError, match="failed on the trainer: ValueError") as info:
        NCCLSender(nccl(), device=torch.device("cpu")).send(small_state())
    assert isinstance(info.value.__cause__, ValueError)


def test_the_records_init_and_update_info_are_accepted_by_vllms_dataclasses():
    pytest.importorskip("vllm")
    from vllm.distributed.weight_transfer.nccl_engine import (NCCLWeightTransferInitInfo,
                                                              NCCLWeightTransferUpdateInfo)

    record = record_of(small_state(), 1, uri=transfer_uri(nccl(num_engine_workers=2)))
    init = NCCLWeightTransferInitInfo(**worker_init_info(record["uri"], 2, 1))
    assert (init.rank_offset, init.world_size, init.packed) == (2, 3, True)
    assert NCCLWeightTransferUpdateInfo(**update_info(record)).dtype_names == ["float32", "bfloat16"]


# ---- shared by the engine-side tests ------------------------------------------------------------

def start_engine(model_dir, backend: str, extension: str, **kwargs: Any):
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.v1.engine.async_llm import AsyncLLM

    return AsyncLLM.from_engine_args(AsyncEngineArgs(
        model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True, seed=0,
        logprobs_mode="processed_logprobs", generation_config="vllm", disable_log_stats=True,
        worker_extension_cls=extension, weight_transfer_config={"backend": backend}, **kwargs))


async def refit(llm, receiver, record: dict[str, Any]) -> list[dict[str, Any]]:
    """VLLMEngine.load_weights' steps with step 2 through the weight-transfer API."""
    await llm.pause_generation(mode="keep", clear_cache=False)  # 1) pause
    try:
        results = await receiver.receive(llm, record)  # 2) receive
        await llm.update_weight_version(str(record["policy_version"]))  # 3) relabel
        await llm.reset_prefix_cache()  # 4) clear the cache (nothing in flight here), resume
    finally:
        await llm.resume_generation()
    return results


async def engine_logprobs(llm, token_ids: list[int], request_id: str) -> list[float]:
    """[P-1] raw prompt logprobs, as VLLMEngine.prompt_logprobs asks for them."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=1.0, max_tokens=1, prompt_logprobs=0, detokenize=False)
    final = None
    async for out in llm.generate(TokensPrompt(prompt_token_ids=token_ids), params, request_id):
        final = out
    return [float(step[t].logprob) for step, t in zip(final.prompt_logprobs[1:], token_ids[1:])]


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
    pytest.importorskip("vllm")
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from molt.engines.weights import publish_weights
    from tests.doubles.file_transfer import BACKEND, EXTENSION, FileReceiver

    model = AutoModelForCausalLM.from_pretrained(small_llama, dtype=torch.float32).eval()
    receiver = FileReceiver(digest=True)

    async def main() -> None:
        llm = start_engine(small_llama, BACKEND, EXTENSION, kv_cache_memory_bytes=2**27)
        try:
            before = await engine_logprobs(llm, PROBE, "probe-0")
            assert max_diff(before, trainer_logprobs(model, PROBE)) < 1e-3
            # 1) a good refit: every tensor's digest as the loader consumed it, and the probe
            state = step(model, seed=1)
            record = {**publish_weights(state, tmp_path / "v1.safetensors", 1), **tensor_layout(state)}
            results = await refit(llm, receiver, record)
            verify_refit(1, sent(record), results[0]["digests"])
            after = await engine_logprobs(llm, PROBE, "probe-1")
            assert max_diff(after, trainer_logprobs(model, PROBE)) < 1e-3  # tied head included
            assert max_diff(after, before) > 1e-3
            # 2) later tokens carry the new version
            from vllm import SamplingParams
            async for out in llm.generate({"prompt_token_ids": PROBE}, SamplingParams(max_tokens=3, temperature=0), "g"):
                final = out
            assert {span.version for span in final.outputs[0].weight_versions} == {"1"}
            # 3) a refit corrupted on the way (one tensor zeroed after the digests) is caught by name
            state2 = step(model, seed=2)
            record2 = {**publish_weights(state2, tmp_path / "v2.safetensors", 2), **tensor_layout(state2)}
            save_file({**state2, "model.norm.weight": torch.zeros_like(state2["model.norm.weight"])},
                      str(tmp_path / "v2.safetensors"))
            results2 = await refit(llm, receiver, record2)
            with pytest.raises(RuntimeError, match=r"1 tensor\(s\) differ.*model\.norm\.weight"):
                verify_refit(2, sent(record2), results2[0]["digests"])
        finally:
            llm.shutdown()
            del llm  # else AsyncLLM.__del__ shuts down again at interpreter exit, noisily

    asyncio.run(main())


# ---- GPU: one refit through NCCL ---------------------------------------------------------------

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def publish(llm, sender, receiver, state: dict[str, torch.Tensor], sent_state: dict[str, torch.Tensor],
                  version: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Version ``version``'s record (digests of ``state``), then trainer and engine meet in NCCL:
    the trainer sends ``sent_state`` while the engine receives."""
    record = record_of(state, version, **sender.record_fields(state))
    results, _ = await asyncio.gather(refit(llm, receiver, record), asyncio.to_thread(sender.send, sent_state))
    return record, results


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices: NCCL refuses two ranks on one GPU")
def test_one_nccl_refit_from_a_trainer_gpu_to_a_vllm_engine_gpu_is_verified(default_model_dir):
    """Unverified: not yet run on a GPU. Needs 2 CUDA devices and vLLM's GPU build: the
    trainer (this process) on cuda:1, the engine's worker on cuda:0 (NCCL refuses two
    ranks on one device). fp32 both sides; the probe tolerance is not yet calibrated on
    GPUs (if the build refuses fp32 attention, use bfloat16 and an atol near 1)."""
    pytest.importorskip("vllm")
    from transformers import AutoModelForCausalLM

    from molt.engines.nccl_transfer import TRANSFER_WORKER_EXTENSION, NCCLSender, TransferReceiver

    transport = nccl(master_port=free_port(), num_engine_workers=1, timeout_s=300)
    check_transport(transport, WHERE)
    device = torch.device("cuda", 1)
    torch.backends.cuda.matmul.allow_tf32 = False
    model = AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).to(device).eval()
    sender, receiver = NCCLSender(transport, device=device), TransferReceiver(rank_offset(0, 1), 1, digest=True)

    async def main() -> None:
        llm = start_engine(default_model_dir, "nccl", TRANSFER_WORKER_EXTENSION, gpu_memory_utilization=0.3)
        try:
            before = await engine_logprobs(llm, PROBE, "probe-0")
            state = step(model, seed=1)
            record, results = await publish(llm, sender, receiver, state, state, 1)
            verify_refit(1, sent(record), results[0]["digests"])
            after = await engine_logprobs(llm, PROBE, "probe-1")
            assert max_diff(after, trainer_logprobs(model, PROBE)) < 1e-2
            assert max_diff(after, before) > 1e-3
            state2 = step(model, seed=2)  # corrupted in transit: digests of state2, bytes of another
            corrupted = {**state2, "model.norm.weight": torch.zeros_like(state2["model.norm.weight"])}
            record2, results2 = await publish(llm, sender, receiver, state2, corrupted, 2)
            with pytest.raises(RuntimeError, match=r"model\.norm\.weight"):
                verify_refit(2, sent(record2), results2[0]["digests"])
        finally:
            sender.close()
            llm.shutdown()
            del llm  # else AsyncLLM.__del__ shuts down again at interpreter exit, noisily

    asyncio.run(main())
