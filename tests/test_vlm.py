"""Vision-language policies: images in the record, the engine and the trainer (molt.models.images).

The policy is a LLaVA-style VLM built by molt.models.vlm from a tiny 2-layer MoE with
SmolLM2's tokenizer (fast); vLLM serves it in the session's event loop.
"""

from __future__ import annotations

import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from molt.agents import ChatTemplate
from molt.agents.episode import Segment
from molt.engines.base import SamplingParams
from molt.models.images import VisionProcessor, image_part, packed_vision_inputs
from molt.train.packing import pack_sequences

HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
            "chat_template.jinja", "processor_config.json")


def png(colour: tuple[int, int, int], box: tuple[int, int, int, int] = (8, 8, 40, 40)) -> bytes:
    image = Image.new("RGB", (64, 64), (255, 255, 255))
    ImageDraw.Draw(image).ellipse(box, fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def ask(image: bytes, text: str = "What colour is the shape?") -> list[dict]:
    return [{"role": "user", "content": [image_part(image), {"type": "text", "text": text}]}]


@pytest.fixture(scope="session")
def tiny_vlm(default_model_dir, tmp_path_factory) -> Path:
    """A 2-layer random Llama (head_dim 64, which vLLM's CPU attention needs) with SmolLM2's tokenizer,
    upcycled to 4 experts (top-2, each perturbed differently), with a fresh 1-layer CLIP tower:
    16 image tokens per 64x64 image."""
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    from molt.models.upcycle import upcycle
    from molt.models.vlm import build_vlm

    root = tmp_path_factory.mktemp("vlm")
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, root / name)
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=49152, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512,
                                 eos_token_id=2, bos_token_id=1, pad_token_id=2,
                                 tie_word_embeddings=True)).save_pretrained(root)
    moe = upcycle(root, root / "moe", num_experts=4, top_k=2)
    lm = AutoModelForCausalLM.from_pretrained(moe)
    with torch.no_grad():  # distinct experts: a token sent to the wrong one would show
        for layer in lm.model.layers:
            for p in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
                p.add_(torch.randn_like(p) * 0.02)
    lm.save_pretrained(root / "moe-distinct")
    shutil.copy(moe / "chat_template.jinja", root / "moe-distinct")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(moe / name, root / "moe-distinct" / name)
    return build_vlm(root / "moe-distinct", root / "tiny-vlm", vision_hidden=64, vision_layers=1)


def test_images_become_the_models_image_tokens_and_travel_with_the_row(tiny_vlm):
    chat = ChatTemplate.for_model(tiny_vlm)
    vision = chat.vision
    assert vision is not None and vision.tokens_per_image == 16
    red, blue = png((255, 0, 0)), png((0, 0, 255))
    ids = chat.prompt_ids(ask(red))
    assert ids.count(vision.image_token_id) == 16 and chat.images(ask(red)) == [red]
    first = ids.index(vision.image_token_id)
    assert ids[first:first + 16] == [vision.image_token_id] * 16  # one run, where the placeholder was
    # a second turn whose env message holds an image: the delta carries its 16 tokens and the image
    messages = [*ask(red), {"role": "assistant", "content": "red"}]
    delta = chat.turn_delta_ids(messages, ask(blue, "And this one?"), ended_with_eos=True)
    assert delta.count(vision.image_token_id) == 16 and chat.images(ask(blue)) == [blue]
    seg = Segment(image_token_id=vision.image_token_id)
    seg.extend_context(ids, [red])
    seg.extend_context(delta, [blue])
    row = seg.row()
    assert row["images"] == [red, blue]
    assert row["image_token_positions"] == [i for i, t in enumerate(ids + delta) if t == vision.image_token_id]
    assert len(row["image_token_positions"]) == 32
    assert Segment().row()["images"] is None  # text-only rows: null


def test_an_image_whose_placeholder_count_mismatches_is_refused_naming_the_sample(tiny_vlm):
    chat = ChatTemplate.for_model(tiny_vlm)
    vision = chat.vision
    assert vision is not None
    red = png((255, 0, 0))
    ids = chat.prompt_ids(ask(red))
    cut = ids[:ids.index(vision.image_token_id) + 5]  # truncated inside the image
    with pytest.raises(ValueError, match=r"sample 'p/0': 5 image tokens .* 1 image\(s\) of 16 tokens"):
        vision.check(cut, [red], "p/0")
    rows = [ids, ids]
    packed = pack_sequences(rows)
    with pytest.raises(ValueError, match=r"sample 'two': 16 image tokens .* 2 image\(s\)"):
        packed_vision_inputs(vision, rows, [[red], [red, red]], ["one", "two"], packed.token_index)
    with pytest.raises(ValueError, match=r"sample 'none': 16 image tokens .* 0 image\(s\)"):
        packed_vision_inputs(vision, rows, [[red], None], ["one", "none"], packed.token_index)
    with pytest.raises(ValueError, match=r"sample 'one': 1 image\(s\) \(column images\) for a text-only model"):
        packed_vision_inputs(None, rows, [[red], None], ["one", "none"], packed.token_index)
    with pytest.raises(ValueError, match="no image processor"):  # a text-only template refuses image parts
        ChatTemplate(chat.tok).prompt_ids(ask(red))
    with pytest.raises(ValueError, match=r"prompt 'p0': \d+ tokens .* exceed max_tokens 40; .* never cut"):
        sft_rows(tiny_vlm, {"red": (255, 0, 0)}, max_tokens=40)  # the image would be cut: the row is refused


def test_a_rollout_whose_policy_generates_the_image_token_counts_as_failed(tiny_vlm):
    import asyncio

    from molt.agents import SingleTurn
    from molt.agents.episode import run_group
    from molt.engines.base import Completion

    chat = ChatTemplate.for_model(tiny_vlm)

    class Generates:  # an engine double whose policy emits the image token, which no image could fill
        async def generate(self, request_id, prompt_token_ids, params, images=()):
            assert images and prompt_token_ids.count(chat.image_token_id) == 16
            return Completion([chat.image_token_id, 2], [-1.0, -1.0], [0, 0], "stop")

    from molt.agents import run_episode

    async def episode(rid):
        return await run_episode(Generates(), chat, SingleTurn(), {"messages": ask(png((255, 0, 0)))},
                                 SamplingParams(), rid)

    rows, failed = asyncio.run(run_group(episode, "p", {}, 0, 2, with_score=False))
    assert rows == [] and len(failed) == 2 and "generated its image token" in str(failed[0][1])


def test_rows_with_the_same_prompt_tokens_but_other_images_never_share_a_prompt_forward(tiny_vlm):
    from molt.train.model import load_policy

    chat = ChatTemplate.for_model(tiny_vlm)
    red, blue = png((255, 0, 0)), png((0, 0, 255), (20, 20, 60, 60))
    prompt = chat.prompt_ids(ask(red))
    assert prompt == chat.prompt_ids(ask(blue))  # same tokens: only the images differ
    answer = chat.encode("red") + [2]
    rows = [prompt + answer, prompt + answer, prompt + answer[:1] + [2]]
    masks = [[False] * len(prompt) + [True] * (len(r) - len(prompt)) for r in rows]
    images = [[red], [blue], [red]]
    packed = pack_sequences(rows, masks, [tuple(i) for i in images])
    assert [(length, prefix) for length, prefix, _ in packed.segments][0][1] == len(prompt)  # rows 0 and 2 share
    assert sum(length for length, _, _ in packed.segments) == len(prompt) * 2 + len(answer) * 2 + 2
    model = load_policy(tiny_vlm, temperature=1.0).eval()
    vision = packed_vision_inputs(model.vision, rows, images, ["a", "b", "c"], packed.token_index)
    assert vision is not None and vision.tensors["pixel_values"].shape == (2, 3, 64, 64)  # red once (shared), blue
    assert vision.row_images == [[0], [1], [0]]
    with torch.no_grad():
        logp = model(packed.input_ids, packed.position_ids, packed, masks, vision)
        alone = [row_logprobs(model, r, i, m) for r, m, i in zip(rows, masks, images)]
    assert torch.allclose(logp, torch.cat(alone), atol=1e-5)
    assert not torch.allclose(alone[0], alone[1], atol=1e-4)  # the image changes the answer's logprobs


def row_logprobs(model, row: list[int], images: list[bytes], mask: list[bool] | None = None) -> torch.Tensor:
    """[T] logprobs of one row's tokens (0 at the first; only ``mask``'s tokens when given) with its images."""
    packed = pack_sequences([row])
    vision = packed_vision_inputs(model.vision, [row], [images], ["row"], packed.token_index)
    return model(packed.input_ids, packed.position_ids, packed, None if mask is None else [mask], vision)


def sft_rows(model_dir: Path, colours: dict[str, tuple[int, int, int]], max_tokens: int = 256) -> list[dict]:
    from stages.sft_records import SFTRecords

    stage = SFTRecords.__new__(SFTRecords)  # its row() only: no pipeline around it
    stage.config = SFTRecords.Config(model=str(model_dir), max_tokens=max_tokens)
    stage.ctx = type("Ctx", (), {"stage_id": "sft"})()
    stage.chat, stage.demonstrate = ChatTemplate.for_model(model_dir), None
    stage.eos = stage.chat.tok.eos_token_id
    return [stage.row(f"p{i}", {"messages": ask(png(rgb)), "answer": name}) for i, (name, rgb) in
            enumerate(colours.items())]


COLOURS = {"red": (255, 0, 0), "green": (0, 200, 0), "blue": (0, 0, 255), "yellow": (250, 220, 0)}


def sft_batch(rows: list[dict]):
    import pyarrow as pa

    from molt.schema import COLUMNS, make_schema

    names = ("sample_id", "token_ids", "loss_mask", "policy_version", "images")
    columns = {n: [r[n] for r in rows] for n in names}
    columns.update(dp_rank=[0] * len(rows), micro_batch=[0] * len(rows),
                   step_loss_tokens=[sum(sum(r["loss_mask"]) for r in rows)] * len(rows),
                   step_loss_seqs=[len(rows)] * len(rows))
    fields = [COLUMNS[n] for n in names] + [pa.field("dp_rank", pa.int32()), pa.field("micro_batch", pa.int32()),
                                            pa.field("step_loss_tokens", pa.int64()),
                                            pa.field("step_loss_seqs", pa.int64())]
    schema = make_schema(fields, "step")
    return pa.RecordBatch.from_pydict(columns, schema=schema)


def test_sft_records_train_the_vlm_to_name_the_colour_without_rollout_columns(tiny_vlm):
    from molt.train import OptimConfig, load_policy, train_step
    from molt.train.optim import make_optimizer
    from molt.train.step import ObjectiveConfig, check_objective

    rows = sft_rows(tiny_vlm, COLOURS)
    r = rows[0]
    prompt_len = r["loss_mask"].index(True)
    assert r["token_ids"][-1] == 2 and sum(r["loss_mask"]) == len(r["token_ids"]) - prompt_len
    assert set(r["policy_version"]) == {-1} and len(r["image_token_positions"]) == 16
    obj = ObjectiveConfig.model_validate({"policy_loss": {"type": "sft"}})
    with pytest.raises(ValueError, match=r"stages.train.config.correction: SFT has no rollout logprobs"):
        check_objective(ObjectiveConfig.model_validate({"policy_loss": {"type": "sft"},
                                                        "correction": {"type": "tis"}}), "stages.train.config")
    torch.manual_seed(0)
    model = load_policy(tiny_vlm, temperature=1.0)
    optim = OptimConfig(lr=1e-2, warmup_steps=0, grad_clip=1.0)
    optimizer = make_optimizer(model, optim)
    batch = sft_batch(rows)
    losses = [train_step(model, optimizer, batch, obj, optim, version=v).loss for v in range(40)]
    assert losses[-1] < 0.2 * losses[0], losses  # mean token cross-entropy, nats (measured 10.8 -> 1.4)
    # it learned to look: each answer is less likely under another row's image
    from molt.train.step import _micro_loss

    swapped = [dict(r, images=rows[(i + 1) % len(rows)]["images"]) for i, r in enumerate(rows)]
    tokens = sum(sum(r["loss_mask"]) for r in rows)
    with torch.no_grad():
        own, other = (float(_micro_loss(model.eval(), sft_batch(rs), obj, tokens, len(rs))[0]) for rs in (rows, swapped))
    assert own < other, (own, other)


def test_the_built_in_vlm_names_resolve_and_an_export_name_becomes_a_model_name(tmp_path, monkeypatch):
    from molt.models import export_path, resolve_model

    monkeypatch.setenv("MOLT_CACHE", str(tmp_path))
    with pytest.raises(ValueError, match="built-in model's name"):
        export_path("smollm2-135m-instruct-moe-vlm")
    folder = export_path("my-sft")
    assert folder == tmp_path / "models" / "my-sft"
    with pytest.raises(ValueError, match="pipelines/sft.yaml"):
        resolve_model("my-sft")
    folder.mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    assert resolve_model("my-sft") == folder.resolve()


# ---------------------------------------------------------------- vLLM


@pytest.fixture(scope="module")
def vlm_engine(vllm_session, tiny_vlm):
    """A vLLM engine on the tiny VLM MoE recording routing, on the session's event loop."""
    from molt.engines.vllm import VLLMEngine

    loop = vllm_session[0]

    async def start() -> VLLMEngine:
        return VLLMEngine(str(tiny_vlm), dtype="float32", max_model_len=512, kv_cache_gib=0.25,
                          record_routing=True, engine_kwargs={"block_size": 32})

    engine = loop.run_until_complete(start())
    yield engine
    engine.close()


def test_vllm_and_the_trainer_agree_on_image_conditioned_tokens_and_routing(vllm_session, vlm_engine, tiny_vlm):
    from molt.agents import SingleTurn, run_episode
    from molt.train.model import load_policy

    loop = vllm_session[0]
    chat = ChatTemplate.for_model(tiny_vlm)
    params = SamplingParams(temperature=1.0, max_new_tokens=12)
    episodes = [loop.run_until_complete(run_episode(vlm_engine, chat, SingleTurn(), {"messages": ask(png(rgb))},
                                                    params, f"vlm-{name}", max_total_tokens=256))
                for name, rgb in COLOURS.items()]
    model = load_policy(tiny_vlm, temperature=1.0).eval()
    diffs = []
    for ep in episodes:
        seg = ep.segments[0]
        row = seg.row()
        assert len(row["images"]) == 1 and len(row["image_token_positions"]) == 16
        routed = seg.routed_experts
        assert routed is not None and routed.shape[0] == len(seg.token_ids)
        assert (routed[row["image_token_positions"]] >= 0).all()  # image tokens went through the experts too
        with torch.no_grad():
            logp = row_logprobs(model, seg.token_ids, row["images"])
        mask = torch.tensor(seg.loss_mask)
        diffs.append((logp[mask] - torch.tensor(seg.rollout_logprobs)[mask]).abs().max().item())
    assert max(diffs) <= 1e-3, diffs  # the text path's fp32 agreement
    # the engine refuses images whose tokens are not in the prompt, naming the request
    ids = chat.prompt_ids(ask(png((255, 0, 0))))
    with pytest.raises(ValueError, match=r"sample 'vlm-bad': 16 image tokens .* 2 image"):
        loop.run_until_complete(vlm_engine.generate("vlm-bad", ids, params, [png((1, 2, 3))] * 2))


def test_a_vlm_refit_is_verified_and_serves_the_trained_weights(vllm_session, vlm_engine, tiny_vlm):
    from molt.engines.refit import apply_weight_record
    from molt.refit import probe_token_ids
    from molt.train import OptimConfig, full_state_dict, load_policy, train_step
    from molt.train.optim import make_optimizer
    from molt.train.publish import policy_probe, publish_weights
    from molt.train.step import ObjectiveConfig

    loop = vllm_session[0]
    torch.manual_seed(0)
    model = load_policy(tiny_vlm, temperature=1.0)
    optim = OptimConfig(lr=3e-3, warmup_steps=0)
    obj = ObjectiveConfig.model_validate({"policy_loss": {"type": "sft"}})
    result = train_step(model, make_optimizer(model, optim), sft_batch(sft_rows(tiny_vlm, COLOURS)),
                        obj, optim, version=0)
    assert result.grad_norm > 0
    folder = Path(tempfile.mkdtemp(prefix="molt-test-vlm-", dir="/dev/shm"))
    try:
        state = full_state_dict(model)
        assert any(n.startswith("vision_tower.vision_model.") for n in state)  # the names vLLM loads
        probe = policy_probe(model, probe_token_ids(model.lm.config.get_text_config().vocab_size), atol=1e-3)
        record = publish_weights(state, folder / "model.safetensors", vlm_engine.policy_version + 1, probe)
        assert loop.run_until_complete(apply_weight_record(vlm_engine, record))  # digests and probe verified
        assert set(vlm_engine.last_weight_digests) == set(state)  # the vision tower and projector too
        chat = ChatTemplate.for_model(tiny_vlm)
        ids = chat.prompt_ids(ask(png((0, 0, 255))))
        out = loop.run_until_complete(vlm_engine.generate("vlm-after", ids, SamplingParams(temperature=1.0,
                                                                                          max_new_tokens=8),
                                                          [png((0, 0, 255))]))
        assert set(out.policy_versions) == {record["policy_version"]}
        full = ids + out.token_ids
        model.eval()
        with torch.no_grad():
            logp = row_logprobs(model, full, [png((0, 0, 255))])[len(ids):]
        assert (logp - torch.tensor(out.logprobs)).abs().max().item() <= 1e-3  # the trained tower and projector
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_the_vlm_folder_loads_in_transformers_under_the_names_vllm_needs(tiny_vlm):
    from safetensors import safe_open

    with safe_open(str(tiny_vlm / "model.safetensors"), "pt") as f:
        names = list(f.keys())
    assert any(n.startswith("vision_tower.vision_model.") for n in names)
    assert not any(n.startswith("vision_tower.embeddings") for n in names)
    provenance = json.loads((tiny_vlm / "molt-model.json").read_text())
    assert provenance["image_tokens"] == 16
    assert VisionProcessor.of(tiny_vlm) is not None and VisionProcessor.of(tiny_vlm.parent) is None


# ---------------------------------------------------------------- the shipped pipelines, on the tiny VLM


def test_sft_then_rl_on_the_tiny_vlm_record_images_and_replay_them_bit_exactly(tiny_vlm, tmp_path, no_orphans):
    import subprocess
    import sys

    from molt.runtime.pipeline import Pipeline
    from molt.runtime.recording import read_batches
    from tests.conftest import run_spec

    pytest.importorskip("vllm")
    sft = Pipeline.from_yaml("pipelines/sft.yaml").to_dict()
    stages = sft["stages"]
    stages["source"]["config"]["task"]["num_problems"] = 32
    stages["source"]["config"]["prompts_per_batch"] = 8
    sft["policy"].update(model=str(tiny_vlm), groups_per_step=8)
    export = tmp_path / "models" / "tiny-vlm-sft"
    stages["train"]["config"].update(export_model=str(export), compute_dtype="float32")
    hf = {"type": "transformers", "dtype": "float32"}  # the evaluations (vLLM serving the VLM: the rollout's)
    stages["evaluate"]["config"].update(every_versions=4, engine=hf)
    stages["evaluate"]["config"]["task"]["num_problems"] = 8
    code, summary = run_spec(sft, tmp_path / "sft")
    assert code == 0, summary["error"]
    assert summary["results"]["steps"] == 4 and summary["results"]["evaluated_version"] == 4
    assert (export / "model.safetensors").is_file() and (export / "processor_config.json").is_file()

    rl = Pipeline.from_yaml("pipelines/vlm_moe.yaml").to_dict()
    stages = rl["stages"]
    stages["source"]["config"].update(prompts_per_batch=4, checkpoint_every_batches=0)
    stages["source"]["config"]["task"]["num_problems"] = 8
    rl["policy"].update(model=str(export), groups_per_step=4)
    stages["rollout"]["config"].update(group_size=2, max_concurrent_groups=4, max_turns=2)  # a second look
    stages["train"]["config"].update(compute_dtype="float32")
    stages["evaluate"]["config"].update(every_versions=2, engine=hf)
    stages["evaluate"]["config"]["task"]["num_problems"] = 8
    code, summary = run_spec(rl, tmp_path / "rl")
    assert code == 0, summary["error"]
    assert summary["results"]["steps"] == 2
    recorded = tmp_path / "rl" / "record" / "rollout.out--shape.in"
    rows = [r for b in read_batches(recorded) for r in b.to_pylist()]
    assert len(rows) >= 16 and all(len(r["images"]) == 1 and len(r["image_token_positions"]) == 16 for r in rows)
    assert all(r["routed_experts"] is not None and r["score"] in (0.0, 1.0) for r in rows)
    from molt.runtime.recording import summarize

    assert '"<' in summarize(recorded) and "images" in summarize(recorded)  # molt inspect shows bytes by size
    for r in rows:  # the picture in the row is the task's picture
        task = json.loads(r["metadata"])
        assert r["images"][0] == ChatTemplate.for_model(export).images(task["messages"])[0]
    out = subprocess.run([sys.executable, "-m", "molt", "replay", str(recorded), "pipelines/vlm_moe.yaml",
                          "--run-dir", str(tmp_path / "replay"), "--set", f"policy.model={export}",
                          "--set", f"stages.evaluate.config.engine={json.dumps(hf)}",
                          "--set", "stages.evaluate.config.task.num_problems=8",
                          "--set", "stages.train.config.compute_dtype=float32",
                          "--set", "policy.groups_per_step=4"],
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    a = (recorded / "rollout.0.arrow").read_bytes()
    b = (tmp_path / "replay" / "record" / "replay.out--shape.in" / "replay.0.arrow").read_bytes()
    assert len(a) > 10_000 and a == b  # images, routing and all, bit for bit


def test_the_vlm_pipelines_load_and_the_gpu_recipe_shards_engines_and_trainer():
    from molt.runtime.pipeline import Pipeline

    cpu, gpu = Pipeline.from_yaml("pipelines/vlm_moe.yaml"), Pipeline.from_yaml("pipelines/vlm_moe_gpu.yaml")
    assert cpu.stages["rollout"].config.engine.record_routing and cpu.stages["train"].config.routing_replay
    assert gpu.stages["rollout"].config.engine.tensor_parallel_size == 2
    assert gpu.stages["rollout"].gpus == [0, 1, 2, 3] and gpu.stages["train"].config.expert_parallel_size == 4
    sft = Pipeline.from_yaml("pipelines/sft.yaml")
    assert sft.stages["train"].config.export_model == cpu.stages["train"].config.model == "shapes-vlm-moe-sft"
    record = sft.stages["source"].config.task.load().record(0)
    assert record["answer"] in {f"{n} {c}" for n in range(1, 5) for c in ("red", "green", "blue", "yellow")}


def test_lora_on_a_vlm_adapts_the_language_model_only(tiny_vlm):
    """The attention targets' q/k/v_proj are also the CLIP tower's; adapters stay out of the tower and projector
    (vLLM's LoRA adapts the language model only: molt.train.lora.outside_language_model, found by structure)."""
    from molt.policy import LoraConfig
    from molt.train import load_policy

    model = load_policy(tiny_vlm, 1.0)
    assert any("vision_tower" in n and n.endswith("q_proj.weight") for n, _ in model.named_parameters())
    model.add_lora(LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}  # adapters, and the MoE's routers in full
    assert any(".lora_" in n for n in trained) and all(".language_model." in n for n in trained), sorted(trained)[:3]


def test_only_a_lora_policy_needs_its_vlms_language_model_found(tiny_vlm, tmp_path, monkeypatch):
    """A VLM whose language model transformers cannot find (get_decoder) trains in full and publishes; with
    LoRA it is refused, as its tower could not be kept free of adapters."""
    from molt.policy import LoraConfig
    from molt.refit import PublishConfig
    from molt.train import load_policy
    from molt.train.publish import Publisher

    model = load_policy(tiny_vlm, 1.0)
    monkeypatch.setattr(type(model.lm), "get_decoder", lambda self: self)
    assert Publisher(PublishConfig(dir=str(tmp_path)), model, 0, "policy.weights").exclude is None
    with pytest.raises(ValueError, match="get_decoder"):
        model.add_lora(LoraConfig(rank=4, alpha=8, target_modules=["q_proj"]))


def test_an_engine_merges_a_vlm_adapter_into_the_weights_under_their_checkpoint_names(tiny_vlm):
    """A LLaVA checkpoint stores the model's ``model.language_model.X`` as ``language_model.model.X``: the
    engine's merge (molt.engines.refit.merged_checkpoint, CPU's default) finds each adapted weight under its
    checkpoint name and gives the trainer's merged weights bit for bit."""
    from molt.engines.refit import merged_checkpoint
    from molt.policy import LoraConfig
    from molt.train import full_state_dict, load_policy, shard_policy
    from molt.train.lora import adapter_state

    model = load_policy(tiny_vlm, 1.0)
    model.add_lora(LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    model = shard_policy(model)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".lora_B." in name:
                param.normal_(0, 0.02)
    adapter = adapter_state(model)
    assert any(".language_model." in name for name in adapter)
    merged, trainers = merged_checkpoint(tiny_vlm, adapter, 2.0), full_state_dict(model)
    assert any(name.startswith("language_model.model.") for name in merged)
    assert set(merged) == set(trainers) and all(torch.equal(merged[k], trainers[k]) for k in merged)


def test_a_vlm_checkpoint_is_a_model_folder_under_its_own_names_and_resumes_to_the_same_next_step(tiny_vlm, tmp_path):
    """A LLaVA's checkpoint holds its folder's names (``language_model.model.X``, not the module's
    ``model.language_model.X``), and a resumed trainer takes the next step exactly: parameters that never
    had a gradient (the CLIP tower's last layer norm, whose output LLaVA does not read) have no AdamW state."""
    from safetensors import safe_open

    from molt.train import OptimConfig, load_policy, shard_policy, train_step
    from molt.train.optim import make_optimizer
    from molt.train.state import load_train_state, save_train_state
    from molt.train.step import ObjectiveConfig

    obj, optim = ObjectiveConfig.model_validate({"policy_loss": {"type": "sft"}}), OptimConfig(lr=1e-3)
    batch = sft_batch(sft_rows(tiny_vlm, COLOURS))

    def policy():
        torch.manual_seed(0)
        model = shard_policy(load_policy(tiny_vlm, temperature=1.0))
        return model, make_optimizer(model, optim)

    model, optimizer = policy()
    train_step(model, optimizer, batch, obj, optim, version=0)
    assert any(p.grad is None and p.requires_grad for p in model.parameters()), "a parameter without a gradient"
    save_train_state(tmp_path / "ckpt", model, optimizer, tiny_vlm)
    with safe_open(str(tmp_path / "ckpt" / "model.safetensors"), "pt") as saved, \
            safe_open(str(tiny_vlm / "model.safetensors"), "pt") as started:
        assert set(saved.keys()) == set(started.keys())
    resumed, resumed_optimizer = policy()
    load_train_state(tmp_path / "ckpt", resumed, resumed_optimizer, tiny_vlm)
    losses = [train_step(m, o, batch, obj, optim, version=1).loss for m, o in ((model, optimizer),
                                                                              (resumed, resumed_optimizer))]
    assert losses[0] == losses[1], losses
