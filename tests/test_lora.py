"""LoRA (molt.train.lora): only adapters train, merged refits, peft-format checkpoints, exact resume."""

import asyncio
import json
import os

import pytest
import torch

from molt.train import full_state_dict, load_policy, shard_policy, train_step
from molt.policy import LoraConfig
from molt.train.optim import make_optimizer
from molt.train.packing import pack_sequences
from molt.train.state import export_model_folder, load_train_state, save_train_state
from tests.conftest import run_spec
from tests.test_train import (OBJECTIVE, OPTIM, TEMPERATURE, check_two_ranks_give_the_one_rank_update, random_groups,
                              rl_pipeline, step_batch, with_evaluation)

LORA = LoraConfig(rank=4, alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])


def lora_policy(model_dir, config=LORA, compute_dtype="float32"):
    torch.manual_seed(0)
    model = load_policy(model_dir, TEMPERATURE)
    model.add_lora(config, "stages.train.config.lora")
    model = shard_policy(model, compute_dtype)
    return model, make_optimizer(model, OPTIM)


def logprobs(model, rows=((100, 101, 102, 103, 104, 105), (300, 7, 8, 9))):
    packed = pack_sequences([list(r) for r in rows])
    with torch.no_grad():
        return model(packed.input_ids, packed.position_ids)


def test_only_the_adapters_train_and_the_merged_weights_are_the_adapted_model(tiny_chat_model, tmp_path):
    from safetensors.torch import load_file

    model, optimizer = lora_policy(tiny_chat_model)
    base = load_file(str(tiny_chat_model / "model.safetensors"))
    merged = full_state_dict(model)
    assert set(merged) == set(base), "the base model's names: engines load it as a full model"
    assert all(torch.equal(merged[k], v) for k, v in base.items()), "B starts at zero: version 0 is the base"
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    assert len(trained) == 2 * 3 * 2 and all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert sum(len(g["params"]) for g in optimizer.param_groups) == len(trained), "AdamW holds the adapters only"
    result = train_step(model, optimizer, step_batch(random_groups()), OBJECTIVE, OPTIM, version=0)
    assert result.grad_norm > 0
    state = model.state_dict()
    q, k = "model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj"
    assert torch.equal(state[f"lm.{q}.base_layer.weight"], base[f"{q}.weight"]), "the base stays frozen"
    assert state[f"lm.{q}.lora_B.default.weight"].abs().max() > 0
    merged = full_state_dict(model)
    assert not torch.equal(merged[f"{q}.weight"], base[f"{q}.weight"])
    assert torch.equal(merged[f"{k}.weight"], base[f"{k}.weight"]), "k_proj has no adapter"
    # what a refit sends (the merged weights) is the policy the trainer computes its logprobs with
    plain = load_policy(export_model_folder(model, tiny_chat_model, tmp_path / "merged"), TEMPERATURE)
    torch.testing.assert_close(logprobs(plain), logprobs(model), atol=2e-6, rtol=0)


def test_a_lora_checkpoint_holds_a_peft_adapter_and_resumes_to_the_same_next_step(tiny_chat_model, tmp_path, caplog):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    batches = [step_batch(random_groups(seed=s)) for s in (0, 1)]
    model, optimizer = lora_policy(tiny_chat_model)
    train_step(model, optimizer, batches[0], OBJECTIVE, OPTIM, version=0)
    save_train_state(tmp_path / "train", model, optimizer, tiny_chat_model)
    config = json.loads((tmp_path / "train" / "adapter" / "adapter_config.json").read_text())
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["modules_to_save"] is None
    assert config["base_model_name_or_path"] == str(tiny_chat_model)
    ids = torch.tensor([[1, 100, 101, 102, 103]])
    with torch.no_grad():
        ours = model.lm(input_ids=ids).logits
        peft = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chat_model),
                                         tmp_path / "train" / "adapter")(input_ids=ids).logits
        merged = AutoModelForCausalLM.from_pretrained(tmp_path / "train")(input_ids=ids).logits
    torch.testing.assert_close(peft, ours, atol=1e-5, rtol=0)
    torch.testing.assert_close(merged, ours, atol=1e-5, rtol=0)

    resumed, resumed_optimizer = lora_policy(tiny_chat_model)
    load_train_state(tmp_path / "train", resumed, resumed_optimizer, tiny_chat_model)
    one = train_step(model, optimizer, batches[1], OBJECTIVE, OPTIM, version=1)
    two = train_step(resumed, resumed_optimizer, batches[1], OBJECTIVE, OPTIM, version=1)
    assert two.loss == one.loss
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

    for change, refused in (({"rank": 8}, r"adapter has lora rank 4 \(now 8\); hint: resume with the lora"),
                            ({"alpha": 16, "dropout": 0.1}, r"lora alpha 8 \(now 16\), dropout 0.0 \(now 0.1\)"),
                            ({"target_modules": ["q_proj"]}, r"tensors differ .* names or shapes, e.g. .*v_proj")):
        other, other_optimizer = lora_policy(tiny_chat_model, LORA.model_copy(update=change))
        with pytest.raises(ValueError, match=refused):
            load_train_state(tmp_path / "train", other, other_optimizer, tiny_chat_model)
    load_train_state(tmp_path / "train", resumed, resumed_optimizer, tmp_path / "elsewhere")
    assert f"its adapter was trained on {tiny_chat_model}; policy.model is {tmp_path / 'elsewhere'}" in caplog.text


def test_lora_refuses_what_it_cannot_adapt_naming_the_key(tiny_chat_model, tiny_moe):
    def apply(model_dir, targets):
        load_policy(model_dir, TEMPERATURE).add_lora(LoraConfig(target_modules=targets), "stages.train.config.lora")

    with pytest.raises(ValueError, match=r"stages.train.config.lora.target_modules: .*q_prj"):
        apply(tiny_chat_model, ["q_prj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: model.embed_tokens is Embedding; adapters go on"):
        apply(tiny_chat_model, ["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: lm_head is the output head; adapters go on"):
        apply(tiny_chat_model, ["lm_head", "q_proj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: model.layers.0.mlp.gate is a router"):
        apply(tiny_moe, ["gate", "q_proj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: \['v_prj'\] match no linear layer of the model"):
        apply(tiny_chat_model, ["q_proj", "v_prj"])  # peft refuses only targets that all match nothing
    with pytest.raises(ValueError, match=r"\['gate_proj', 'up_proj', 'down_proj'\] match no linear .*\(a MoE's experts"):
        apply(tiny_moe, LoraConfig().target_modules)  # the default targets: the experts are fused parameters


def moe_lora_policy(model_dir, freeze_router):
    """The MoE policy with adapters on q_proj, its routers trained in full unless ``freeze_router`` (unsharded)."""
    from molt.train.moe import apply_moe_keys

    model = load_policy(model_dir, TEMPERATURE)
    config = type("C", (), {"router_aux_loss_coef": 0.0, "routing_replay": False, "routing_replay_compare": False,
                            "freeze_router": freeze_router})
    apply_moe_keys(config, model.lm, "stages.train.config")
    model.add_lora(LoraConfig(target_modules=["q_proj"]))
    return model


@pytest.mark.parametrize("freeze_router", [False, True])
def test_a_moe_under_lora_trains_its_routers_in_full_unless_frozen(tiny_moe, tmp_path, freeze_router):
    model = moe_lora_policy(tiny_moe, freeze_router)
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    routers = {n for n in trained if n.endswith(".mlp.gate.weight")}
    assert len(routers) == (0 if freeze_router else 2) and not any("experts" in n for n in trained)
    assert len(trained - routers) == 2 * 2, "q_proj's A and B in each layer"
    model = shard_policy(model)
    optimizer = make_optimizer(model, OPTIM)
    save_train_state(tmp_path / "train", model, optimizer, tiny_moe)
    config_file = json.loads((tmp_path / "train" / "adapter" / "adapter_config.json").read_text())
    assert config_file["modules_to_save"] == (None if freeze_router else ["gate"])
    load_train_state(tmp_path / "train", model, optimizer, tiny_moe)


def publish(model, tmp_path, version=1):
    """Publish ``model`` as ``version`` through the train stage's Publisher; (its record, the Publisher)."""
    from molt.refit import PublishConfig
    from molt.train.publish import Publisher

    sent = []

    async def send(batch):
        sent.append(batch.to_pylist()[-1])

    publisher = Publisher(PublishConfig(dir=str(tmp_path / "weights")), model, 0, "policy.weights")
    asyncio.run(publisher.publish(version, send))
    return sent[0], publisher


def test_an_adapter_refit_ships_the_adapter_alone_and_engines_verify_it_served_or_merged(tiny_chat_model, tmp_path):
    from safetensors.torch import load_file

    from molt.engines.hf import TransformersEngine
    from molt.engines.refit import apply_weight_record, merged_checkpoint, read_adapter
    from molt.engines.vllm_lora import load_merged

    model, optimizer = lora_policy(tiny_chat_model)
    train_step(model, optimizer, step_batch(random_groups()), OBJECTIVE, OPTIM, version=0)
    record, publisher = publish(model, tmp_path)
    folder = record["uri"].removeprefix("file://")
    assert record["format"] == "peft" and sorted(os.listdir(folder)) == ["adapter_config.json",
                                                                         "adapter_model.safetensors"]
    assert len(record["tensor_names"]) == 2 * 3 * 2 and all(".lora_" in n for n in record["tensor_names"])
    full = sum(t.numel() * 4 for t in load_file(str(tiny_chat_model / "model.safetensors")).values())
    assert record["num_bytes"] * 10 < full, "the adapter alone"
    # an engine serving adapters (the transformers engine: peft's layers in its model), verified
    engine = TransformersEngine(str(tiny_chat_model))
    assert asyncio.run(apply_weight_record(engine, record)) and engine.policy_version == 1
    torch.testing.assert_close(asyncio.run(engine.prompt_logprobs(record["probe_token_ids"])),
                               record["probe_logprobs"], atol=2e-6, rtol=0)
    # the merge fallback: the base weights with the adapter merged are the trainer's merged weights
    merged, trainers = merged_checkpoint(tiny_chat_model, *read_adapter(folder)), full_state_dict(model)
    assert set(merged) == set(trainers) and all(torch.equal(merged[k], trainers[k]) for k in merged)
    plain = TransformersEngine(str(tiny_chat_model))
    digests = asyncio.run(load_merged(plain.load_weights, tiny_chat_model, folder, 1))
    assert digests == dict(zip(record["tensor_names"], record["tensor_digests"])) and plain.policy_version == 1
    torch.testing.assert_close(asyncio.run(plain.prompt_logprobs(record["probe_token_ids"])),
                               record["probe_logprobs"], atol=2e-6, rtol=0)
    for version in (2, 3):  # an adapter folder is pruned like a weights file
        asyncio.run(publisher.publish(version, lambda batch: asyncio.sleep(0)))
    assert not os.path.exists(folder), "keep_versions 2: version 3's adapter removed version 1's"


def test_vllm_serves_only_the_targets_and_an_engine_whose_model_class_has_no_lora_merges(tiny_chat_model, tmp_path,
                                                                                        caplog):
    from vllm.platforms import current_platform

    from molt.engines.config import EngineConfig
    from molt.engines.vllm_lora import engine_kwargs, served_adapters

    cpu = current_platform.is_cpu()

    assert engine_kwargs(LORA, 2) == {"enable_lora": True, "max_lora_rank": 8, "max_loras": 2, "max_cpu_loras": 3,
                                      "lora_target_modules": ["q_proj", "v_proj", "down_proj"]}
    with pytest.raises(ValueError, match="lora.rank: vLLM serves adapters up to rank 512; got 600"):
        engine_kwargs(LoraConfig(rank=600), 2)
    served = EngineConfig(lora=LORA, serve_adapters=True)
    assert served_adapters(served, str(tiny_chat_model), "e") == LORA, "vLLM's Llama serves adapters"
    assert served_adapters(EngineConfig(lora=LORA, serve_adapters=False), str(tiny_chat_model), "e") is None
    assert served_adapters(EngineConfig(lora=LORA), str(tiny_chat_model), "e") == (None if cpu else LORA)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    assert served_adapters(served, str(tmp_path), "stages.rollout.config.engine") is None, "GPT-2: no LoRA in vLLM"
    assert "stages.rollout.config.engine: vLLM's class for" in caplog.text
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["NotInVLLM"]}))
    assert served_adapters(served, str(tmp_path), "e") == LORA, "vLLM's Transformers backend, which serves adapters"


def test_routers_trained_in_full_make_refits_merged(tiny_moe, tmp_path, caplog):
    record, _ = publish(shard_policy(moe_lora_policy(tiny_moe, freeze_router=False)), tmp_path)
    assert record["format"] == "safetensors" and "policy.weights: refits ship the merged weights, not the adapter " \
        "alone: routers train in full" in caplog.text


def test_lora_on_two_fsdp2_ranks_gives_the_one_rank_update(tiny_chat_model, tmp_path):
    check_two_ranks_give_the_one_rank_update(tiny_chat_model, tmp_path, LORA)


def test_a_lora_rl_loop_refits_verified_adapters_and_exports_the_adapter(tiny_chat_model, tmp_path, no_orphans):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from molt.commands.export import export_run

    spec = with_evaluation(rl_pipeline(tiny_chat_model, 1), tiny_chat_model)  # on-policy: refits before step 1
    spec["stages"]["source"]["config"]["checkpoint_every_batches"] = 1
    spec["stages"]["train"]["config"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec["stages"]["train"]["config"]["optim"] = {"lr": 1e-2}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    m = summary["metrics"]
    assert m["train/policy_version"] == 2 and m["rollout/refit_seconds"] >= 0, "refits loaded and verified"
    log = (tmp_path / "run" / "logs" / "rollout.0.log").read_text()
    assert "loaded the adapter of version 1" in log and "refit to version 1 verified" in log
    assert m["train/grad_norm"] > 0
    out, version = export_run(tmp_path / "run", None, tmp_path / "export")
    ids = torch.tensor([[1, 100, 101, 102]])
    with torch.no_grad():
        merged = AutoModelForCausalLM.from_pretrained(out)(input_ids=ids).logits
        adapted = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_chat_model),
                                            out / "adapter")(input_ids=ids).logits
        base = AutoModelForCausalLM.from_pretrained(tiny_chat_model)(input_ids=ids).logits
    assert version >= 1 and (merged - base).abs().max() > 1e-4, "trained"
    torch.testing.assert_close(adapted, merged, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name, base", [("quickstart_lora", "quickstart"), ("moe_lora", "moe"),
                                        ("vlm_moe_lora", "vlm_moe")])
def test_a_lora_pipeline_is_its_base_with_adapters_frozen_routers_and_a_tenfold_lr(name, base):
    from molt.runtime.pipeline import Pipeline

    full, lora = (Pipeline.from_yaml(f"pipelines/{n}.yaml") for n in (base, name))
    stages, adapters = lora.stages, lora.stages["train"].config.lora
    assert adapters is not None and adapters.rank == 16 and adapters.alpha == 32
    assert stages["train"].config.lora == stages["rollout"].config.engine.lora == \
        stages["evaluate"].config.engine.lora == adapters, "trained and served"
    full_dict, lora_dict = full.to_dict(), lora.to_dict()
    train, optim = lora_dict["stages"]["train"]["config"], full_dict["stages"]["train"]["config"]["optim"]
    assert lora_dict["policy"].pop("lora") == adapters.model_dump()
    if name == "quickstart_lora":  # the constant lr it was measured with: ten times the quickstart's before its decay
        assert (train["optim"]["lr"], train["optim"]["decay"], optim["decay"]) == (2.0e-4, "constant", "cosine")
        train["optim"] = dict(optim, lr=10 * optim["lr"])
    assert train["optim"]["lr"] == 10 * optim["lr"]
    train["optim"]["lr"], lora_dict["name"] = optim["lr"], base
    if name != "quickstart_lora":  # a MoE: routers frozen, so every refit is the adapter alone
        assert (train.pop("freeze_router"), train.pop("router_aux_loss_coef")) == (True, 0.0)
        assert adapters.target_modules == ["q_proj", "k_proj", "v_proj", "o_proj"], "the experts are no linears"
        base_train = full_dict["stages"]["train"]["config"]
        base_train.pop("freeze_router", None), base_train.pop("router_aux_loss_coef")
    assert lora_dict == full_dict


def test_two_adapter_versions_live_at_once_on_vllm_each_token_carries_the_version_that_made_it(
        default_model_dir, tmp_path):
    """A request admitted under version 1 finishes on version 1's adapter while version 2's serves a newer
    one (molt.engines.vllm_lora): each token's version is the adapter that produced it, as the trainer's
    logprobs under that version's adapter show (and under the other version's do not)."""
    from molt.engines.base import SamplingParams
    from molt.engines.hf import TransformersEngine
    from molt.engines.refit import apply_weight_record
    from molt.engines.vllm import VLLMEngine

    model, _ = lora_policy(default_model_dir)
    records = {}
    for version in (1, 2):
        torch.manual_seed(version)
        with torch.no_grad():
            for name, param in model.named_parameters():
                if ".lora_B." in name:
                    param.normal_(0, 0.02)
        records[version], _ = publish(model, tmp_path / f"p{version}", version)
    prompt = [1, 504, 3458, 314, 3766, 30, 2, 198]
    params = SamplingParams(temperature=1.0, max_new_tokens=160, stop_token_ids=())  # long enough to span a refit

    async def run():
        engine = VLLMEngine(str(default_model_dir), dtype="float32", max_model_len=256, kv_cache_gib=0.25, lora=LORA,
                            max_loras=2)
        try:
            assert await apply_weight_record(engine, records[1])  # verified: digests and the probe under the adapter
            first = asyncio.create_task(engine.generate("admitted-at-v1", prompt, params))
            await asyncio.sleep(0.2)
            assert await apply_weight_record(engine, records[2]) and not first.done(), "v1's request spans the refit"
            second = asyncio.create_task(engine.generate("admitted-at-v2", prompt, params))
            await asyncio.sleep(0.2)
            assert set(engine._adapters.requests) == {1, 2} and not first.done(), "both adapters live"
            done = await asyncio.gather(first, second)
            assert set(engine._adapters.requests) == {2}, "version 1's adapter unloaded once unused"
            return done
        finally:
            engine.close()

    async def merged():  # an engine that does not serve adapters (on CPU, by default) merges each one, verified
        engine = VLLMEngine(str(default_model_dir), dtype="float32", max_model_len=256, kv_cache_gib=0.25)
        try:
            assert await apply_weight_record(engine, records[1]) and engine.policy_version == 1
            return await engine.generate("merged-v1", prompt, params)
        finally:
            engine.close()

    completions = asyncio.run(run())
    on_merged = asyncio.run(merged())
    assert on_merged.policy_versions == [1] * len(on_merged.token_ids)
    references = {}
    for version in (1, 2):
        references[version] = TransformersEngine(str(default_model_dir))
        asyncio.run(references[version].load_adapter(records[version]["uri"].removeprefix("file://"), version))
    for version, completion in zip((1, 2, 1), (*completions, on_merged)):
        assert completion.policy_versions == [version] * len(completion.token_ids) and len(completion.token_ids) > 4
        scored = {v: asyncio.run(ref.prompt_logprobs(prompt + completion.token_ids))[len(prompt) - 1:]
                  for v, ref in references.items()}
        own = max(abs(a - b) for a, b in zip(scored[version], completion.logprobs))
        other = max(abs(a - b) for a, b in zip(scored[3 - version], completion.logprobs))
        assert own < 1e-4 < 1e-2 < other, (version, own, other)
