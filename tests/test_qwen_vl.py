"""Qwen-VL policies (Qwen3-VL-MoE's architecture at test size, tests/doubles/qwen_vl.py): image tokens
that follow the image's resolution, multimodal RoPE in packed rows, the transformers engine, refits
through the checkpoint's transposed expert layout, and the VLM RL pipeline through the real runner.

vLLM's CPU build cannot serve Qwen-VL here (its processor needs torchvision), so the engine is the
transformers test double; the GPU recipe (pipelines/vlm_moe_gpu_2node.yaml) serves it with vLLM.
"""

from __future__ import annotations

import asyncio
import io
import json
import shutil
import tempfile
from pathlib import Path

import pytest
import torch
from PIL import Image, ImageDraw

from molt.agents import ChatTemplate
from molt.engines.base import SamplingParams
from molt.models.images import VisionProcessor, image_part, packed_vision_inputs
from molt.train.packing import pack_sequences
from tests.doubles.qwen_vl import build_tiny_qwen3_vl_moe


def png(colour: tuple[int, int, int], size: tuple[int, int] = (64, 64)) -> bytes:
    image = Image.new("RGB", size, (255, 255, 255))
    ImageDraw.Draw(image).ellipse((8, 8, 40, 40), fill=colour)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def ask(image: bytes, text: str = "What colour is the shape?") -> list[dict]:
    return [{"role": "user", "content": [image_part(image), {"type": "text", "text": text}]}]


RED, WIDE_BLUE = png((255, 0, 0)), png((0, 0, 255), (96, 64))  # grids (1, 4, 4) and (1, 4, 6)


@pytest.fixture(scope="session")
def tiny_qwen_vl(default_model_dir, tmp_path_factory) -> Path:
    return build_tiny_qwen3_vl_moe(default_model_dir, tmp_path_factory.mktemp("qwen_vl") / "tiny-qwen3-vl-moe")


def rows_of(chat: ChatTemplate) -> tuple[list[list[int]], list[list[bool]], list[tuple[bytes, ...]]]:
    """Two rows sharing a prompt with the red picture, one with the wide blue one, one text-only."""
    red, blue = chat.prompt_ids(ask(RED)), chat.prompt_ids(ask(WIDE_BLUE, "Which colour is it?"))
    text = chat.prompt_ids([{"role": "user", "content": "Name a colour."}])
    answer = chat.encode("red") + [2]
    prompts = [red, red, blue, text]
    rows = [red + answer, red + answer[:1] + [2], blue + answer, text + answer]
    masks = [[False] * len(p) + [True] * (len(r) - len(p)) for p, r in zip(prompts, rows)]
    return rows, masks, [(RED,), (RED,), (WIDE_BLUE,), ()]


def own_forward_logprobs(model, rows, masks, images) -> torch.Tensor:
    """Each row alone through transformers' own forward, which computes the multimodal RoPE itself."""
    out = []
    for row, mask, row_images in zip(rows, masks, images):
        ids = torch.tensor([row])
        inputs = model.vision.model_inputs(list(row_images)) if row_images else {}
        logits = model.lm(input_ids=ids, mm_token_type_ids=(ids == model.vision.image_token_id).int(),
                          **inputs).logits[0, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
        out.append(torch.cat([torch.zeros(1), logp]) * torch.tensor(mask))
    return torch.cat(out)


def test_qwen_vl_images_take_as_many_tokens_as_their_resolution_gives(tiny_qwen_vl):
    chat = ChatTemplate.for_model(tiny_qwen_vl)
    vision = chat.vision
    assert vision is not None and vision.tokens_per_image is None and vision.merge_size == 2
    assert vision.placeholder == "<|vision_start|><|image_pad|><|vision_end|>"
    assert vision.token_counts([RED, WIDE_BLUE]) == [4, 6]  # (1, 4, 4) and (1, 4, 6) patches / 2^2
    ids = chat.prompt_ids(ask(RED))
    start = ids.index(vision.image_token_id)
    assert ids[start - 1:start + 5] == [vision.image_token_id - 2, *[vision.image_token_id] * 4,
                                        vision.image_token_id - 1]  # <|vision_start|> 4 x pad <|vision_end|>
    messages = [*ask(RED), {"role": "assistant", "content": "red"}]
    delta = chat.turn_delta_ids(messages, ask(WIDE_BLUE, "And this one?"), ended_with_eos=True)
    both = ids + delta
    assert both.count(vision.image_token_id) == 10
    assert vision.check(both, [RED, WIDE_BLUE], "p/0") == [4, 6]
    collapsed = vision.collapse(both, [RED, WIDE_BLUE])  # what vLLM is given: one pad per image
    assert collapsed.count(vision.image_token_id) == 2 and vision.expand(collapsed, [RED, WIDE_BLUE]) == both
    with pytest.raises(ValueError, match=r"sample 'p/0': 10 image tokens .* 2 image\(s\) of \[6, 4\] tokens"):
        vision.check(both, [WIDE_BLUE, RED], "p/0")  # the images' order decides each one's count
    with pytest.raises(ValueError, match=r"sample 'p/1': 7 image tokens .*\(expected 10\)"):
        vision.check(both[:vision.positions(both)[6] + 1], [RED, WIDE_BLUE], "p/1")  # cut inside the second image
    with pytest.raises(ValueError, match="1 image placeholders for 2 image"):
        vision.expand(collapsed[:len(collapsed) // 2 + 5], [RED, WIDE_BLUE])


def test_packed_qwen_vl_rows_sharing_a_prompt_match_the_models_own_forward(tiny_qwen_vl):
    from molt.train.model import load_policy

    model = load_policy(tiny_qwen_vl, temperature=1.0).eval()
    assert model.shares_prompts  # the language model runs molt's packed attention
    rows, masks, images = rows_of(ChatTemplate.for_model(tiny_qwen_vl))
    packed = pack_sequences(rows, masks, images)
    assert [prefix > 0 for _, prefix, _ in packed.segments] == [True, False, False]  # the red rows share
    vision = packed_vision_inputs(model.vision, rows, images, ["a", "b", "c", "d"], packed.token_index)
    assert vision is not None and vision.row_images == [[0], [0], [1], []]
    assert vision.tensors["image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]  # red once, then blue
    rope = model.mrope_packed(packed, vision)
    assert rope is not None and rope.shape == (3, 1, packed.input_ids.shape[1])
    assert not torch.equal(rope[1, 0], packed.position_ids[0])  # image tokens sit on a (t, h, w) grid
    with torch.no_grad():
        logp = model(packed.input_ids, packed.position_ids, packed, masks, vision)
        reference = own_forward_logprobs(model, rows, masks, images)
        model.mrope_packed = lambda packed, vision: None  # plain positions instead: measurably off
        flat = model(packed.input_ids, packed.position_ids, packed, masks, vision)
    assert (logp - reference).abs().max().item() <= 1e-5  # measured 1.9e-6
    assert (flat - reference).abs().max().item() > 1e-2


def test_the_transformers_engine_samples_qwen_vl_with_the_trainers_logprobs(tiny_qwen_vl):
    from molt.engines.hf import TransformersEngine
    from molt.train.model import load_policy

    chat = ChatTemplate.for_model(tiny_qwen_vl)
    engine = TransformersEngine(str(tiny_qwen_vl), record_routing=True)
    prompts = [chat.prompt_ids(ask(RED)), chat.prompt_ids(ask(WIDE_BLUE, "Which colour is it?")),
               chat.prompt_ids([{"role": "user", "content": "Name a colour."}])]
    images = [(RED,), (WIDE_BLUE,), ()]
    params = SamplingParams(temperature=1.0, max_new_tokens=10, seed=3)

    async def generate():  # interleaved: each decode step must use its own request's RoPE offset
        return await asyncio.gather(*(engine.generate(f"r{i}", p, params, list(im))
                                      for i, (p, im) in enumerate(zip(prompts, images))))

    completions = asyncio.run(generate())
    with pytest.raises(ValueError, match=r"sample 'bad': 4 image tokens .* 1 image\(s\) of 6 tokens"):
        asyncio.run(engine.generate("bad", prompts[0], params, [WIDE_BLUE]))
    rows = [p + c.token_ids for p, c in zip(prompts, completions)]
    masks = [[False] * len(p) + [True] * len(c.token_ids) for p, c in zip(prompts, completions)]
    assert all(c.routed_experts.shape == (len(r), 2, 2) for r, c in zip(rows, completions))
    model = load_policy(tiny_qwen_vl, temperature=1.0).eval()
    packed = pack_sequences(rows, masks, images)
    with torch.no_grad():
        logp = model(packed.input_ids, packed.position_ids, packed, masks,
                     packed_vision_inputs(model.vision, rows, images, ["a", "b", "c"], packed.token_index))
    sampled = torch.cat([torch.tensor([0.0] * len(p) + c.logprobs) for p, c in zip(prompts, completions)])
    assert sum(len(c.token_ids) for c in completions) >= 20
    assert (logp - sampled).abs().max().item() <= 1e-4  # measured 1.9e-6


def test_a_qwen3_vl_moe_refit_goes_through_the_checkpoint_layout_and_is_verified(tiny_qwen_vl):
    from safetensors import safe_open

    from molt.engines.hf import TransformersEngine
    from molt.engines.refit import apply_weight_record
    from molt.refit import probe_token_ids
    from molt.train import OptimConfig, full_state_dict, load_policy, train_step
    from molt.train.optim import make_optimizer
    from molt.train.publish import policy_probe, publish_weights
    from molt.train.step import ObjectiveConfig
    from tests.test_vlm import sft_batch, sft_rows

    torch.manual_seed(0)
    model = load_policy(tiny_qwen_vl, temperature=1.0)
    optim = OptimConfig(lr=1e-2, warmup_steps=0)
    rows = sft_rows(tiny_qwen_vl, {"red": (255, 0, 0), "blue": (0, 0, 255)})
    assert len(rows[0]["image_token_positions"]) == 4
    result = train_step(model, make_optimizer(model, optim), sft_batch(rows),
                        ObjectiveConfig.model_validate({"policy_loss": {"type": "sft"}}), optim, version=0)
    assert result.grad_norm > 0
    state = full_state_dict(model)
    with safe_open(str(tiny_qwen_vl / "model.safetensors"), "pt") as f:  # the checkpoint's names and shapes
        assert {n: list(t.shape) for n, t in state.items()} == {n: f.get_slice(n).get_shape() for n in f.keys()}
    assert list(state["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape) == [4, 128, 96]  # [E, H, 2I]
    assert list(state["model.language_model.layers.0.mlp.experts.down_proj"].shape) == [4, 48, 128]  # [E, I, H]
    engine = TransformersEngine(str(tiny_qwen_vl))
    folder = Path(tempfile.mkdtemp(prefix="molt-test-qwen-vl-", dir="/dev/shm"))
    try:
        probe = policy_probe(model, probe_token_ids(model.vision.image_token_id), atol=1e-4)
        record = publish_weights(state, folder / "model.safetensors", 1, probe)
        assert asyncio.run(apply_weight_record(engine, record))  # digests and the probe verified
        assert set(engine.last_weight_digests) == set(state)  # vision tower, deepstack mergers, experts
        chat = ChatTemplate.for_model(tiny_qwen_vl)
        ids = chat.prompt_ids(ask(WIDE_BLUE))
        out = asyncio.run(engine.generate("after", ids, SamplingParams(temperature=1.0, max_new_tokens=6, seed=1),
                                          [WIDE_BLUE]))
        assert set(out.policy_versions) == {1}
        row, mask = ids + out.token_ids, [False] * len(ids) + [True] * len(out.token_ids)
        packed = pack_sequences([row])
        with torch.no_grad():
            logp = model.eval()(packed.input_ids, packed.position_ids, packed, [mask],
                                packed_vision_inputs(model.vision, [row], [[WIDE_BLUE]], ["a"], packed.token_index))
        assert (logp[len(ids):] - torch.tensor(out.logprobs)).abs().max().item() <= 1e-4  # the trained experts
        stale = {**record, "policy_version": 2, "probe_logprobs": [x + 0.5 for x in record["probe_logprobs"]]}
        with pytest.raises(RuntimeError, match="probe"):  # a refit whose engine does not compute the probe
            asyncio.run(apply_weight_record(engine, stale))
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def test_vlm_rl_on_a_tiny_qwen3_vl_moe_trains_with_routing_replay_and_verified_refits(tiny_qwen_vl, tmp_path,
                                                                                      no_orphans):
    from molt.runtime.pipeline import Pipeline
    from molt.runtime.recording import read_batches
    from tests.conftest import run_spec

    spec = Pipeline.from_yaml("pipelines/vlm_moe.yaml").to_dict()
    stages = spec["stages"]
    stages["source"]["config"].update(prompts_per_batch=4, checkpoint_every_batches=0)
    stages["source"]["config"]["task"]["num_problems"] = 8
    engine = {"type": "transformers", "record_routing": True}
    spec["policy"].update(model=str(tiny_qwen_vl), groups_per_step=4)
    stages["rollout"]["config"].update(engine=engine, group_size=2, max_concurrent_groups=4, seed=1, max_staleness=0,
                                       env="tests.doubles.agents.LetterShareEnv")  # on-policy: it must refit
    stages["train"]["config"].update(compute_dtype="float32", routing_replay_compare=True)
    stages["evaluate"]["config"].update(every_versions=2, engine={"type": "transformers"})
    stages["evaluate"]["config"]["task"]["num_problems"] = 4
    code, summary = run_spec(spec, tmp_path / "rl")
    assert code == 0, summary["error"]
    assert summary["results"]["steps"] == 2 and summary["results"]["evaluated_version"] == 2
    rows = [r for b in read_batches(tmp_path / "rl" / "record" / "rollout.out--shape.in") for r in b.to_pylist()]
    assert len(rows) == 16 and all(len(r["images"]) == 1 and r["routed_experts"] is not None for r in rows)
    grids = VisionProcessor(tiny_qwen_vl).token_counts([r["images"][0] for r in rows])
    assert all(len(r["image_token_positions"]) == n for r, n in zip(rows, grids))
    metrics = [json.loads(line)["values"] for line in (tmp_path / "rl" / "metrics.jsonl").read_text().splitlines()]
    replay = [m for m in metrics if "train/moe/logprob_diff_replay" in m]
    assert len(replay) == 2 and all(m["train/grad_norm"] > 0 and m["train/moe/routed_token_frac"] > 0.5
                                    for m in replay)
    assert replay[0]["train/moe/routing_disagreement"] == 0.0  # step 0: on-policy, fp32 on both sides
    assert replay[0]["train/moe/logprob_diff_replay"] <= 1e-4  # engine and trainer agree on image tokens too
    refits = [m["rollout/refit_seconds"] for m in metrics if "rollout/refit_seconds" in m]
    assert len(refits) >= 1  # verified: digests and the probe (a failed check fails the run)


def test_vllm_without_torchvision_is_refused_for_qwen_vl_before_it_starts(tiny_qwen_vl):
    import importlib.util

    from molt.engines import EngineConfig, make_engine

    if importlib.util.find_spec("torchvision") is not None:
        pytest.skip("torchvision is installed: vLLM can import Qwen-VL here")
    with pytest.raises(ValueError, match=r"stages.rollout.config.engine.type: vLLM cannot serve "
                                         r"Qwen3VLMoeForConditionalGeneration without torchvision .* hint: engine: "
                                         r"\{type: transformers\}"):
        make_engine(EngineConfig(), str(tiny_qwen_vl), "stages.rollout.config.engine")
