"""LoRA (molt.train.lora): only adapters train, merged refits, peft-format checkpoints, exact resume."""

import json

import pytest
import torch

from molt.train import full_state_dict, load_policy, shard_policy, train_step
from molt.train.lora import LoraConfig
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


def test_a_lora_checkpoint_holds_a_peft_adapter_and_resumes_to_the_same_next_step(tiny_chat_model, tmp_path):
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
    load_train_state(tmp_path / "train", resumed, resumed_optimizer)
    one = train_step(model, optimizer, batches[1], OBJECTIVE, OPTIM, version=1)
    two = train_step(resumed, resumed_optimizer, batches[1], OBJECTIVE, OPTIM, version=1)
    assert two.loss == one.loss
    for (name, p), q in zip(model.state_dict().items(), resumed.state_dict().values(), strict=True):
        assert torch.equal(p, q), name

    other, other_optimizer = lora_policy(tiny_chat_model, LORA.model_copy(update={"rank": 8}))
    with pytest.raises(ValueError, match=r"tensors differ .* names or shapes, e.g. .*lora_A.weight.* hint: resume"):
        load_train_state(tmp_path / "train", other, other_optimizer)


def test_lora_refuses_what_it_cannot_adapt_naming_the_key(tiny_chat_model, tiny_moe):
    def apply(model_dir, targets):
        load_policy(model_dir, TEMPERATURE).add_lora(LoraConfig(target_modules=targets), "stages.train.config.lora")

    with pytest.raises(ValueError, match=r"stages.train.config.lora.target_modules: .*q_prj"):
        apply(tiny_chat_model, ["q_prj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: model.embed_tokens is Embedding; adapters go on"):
        apply(tiny_chat_model, ["embed_tokens", "q_proj"])
    with pytest.raises(ValueError, match=r"lora.target_modules: model.layers.0.mlp.gate is a router"):
        apply(tiny_moe, ["gate", "q_proj"])


@pytest.mark.parametrize("freeze_router", [False, True])
def test_a_moe_under_lora_trains_its_routers_in_full_unless_frozen(tiny_moe, tmp_path, freeze_router):
    from molt.train.moe import apply_moe_keys

    model = load_policy(tiny_moe, TEMPERATURE)
    config = type("C", (), {"router_aux_loss_coef": 0.0, "routing_replay": False, "routing_replay_compare": False,
                            "freeze_router": freeze_router})
    apply_moe_keys(config, model.lm, "stages.train.config")
    model.add_lora(LoraConfig(target_modules=["q_proj"]))
    trained = {n for n, p in model.named_parameters() if p.requires_grad}
    routers = {n for n in trained if n.endswith(".mlp.gate.weight")}
    assert len(routers) == (0 if freeze_router else 2) and not any("experts" in n for n in trained)
    assert len(trained - routers) == 2 * 2, "q_proj's A and B in each layer"
    model = shard_policy(model)
    optimizer = make_optimizer(model, OPTIM)
    save_train_state(tmp_path / "train", model, optimizer, tiny_moe)
    config_file = json.loads((tmp_path / "train" / "adapter" / "adapter_config.json").read_text())
    assert config_file["modules_to_save"] == (None if freeze_router else ["gate"])
    load_train_state(tmp_path / "train", model, optimizer)


def test_lora_on_two_fsdp2_ranks_gives_the_one_rank_update(tiny_chat_model, tmp_path):
    check_two_ranks_give_the_one_rank_update(tiny_chat_model, tmp_path, LORA)


def test_a_lora_rl_loop_refits_verified_merged_weights_and_exports_the_adapter(tiny_chat_model, tmp_path, no_orphans):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from molt.export import export_run

    spec = with_evaluation(rl_pipeline(tiny_chat_model, 1), tiny_chat_model)  # on-policy: refits before step 1
    spec["stages"]["source"]["config"]["checkpoint_every_batches"] = 1
    spec["stages"]["train"]["config"]["lora"] = {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}
    spec["stages"]["train"]["config"]["optim"] = {"lr": 1e-2}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    m = summary["metrics"]
    assert m["train/policy_version"] == 2 and m["rollout/refit_seconds"] >= 0, "refits loaded and verified"
    assert "refit to version 1 verified" in (tmp_path / "run" / "logs" / "rollout.0.log").read_text()
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


def test_quickstart_lora_is_the_quickstart_with_adapters_and_a_tenfold_lr():
    from molt.pipeline import Pipeline

    quick, lora = (Pipeline.from_yaml(f"pipelines/{name}.yaml").to_dict() for name in ("quickstart", "quickstart_lora"))
    train, lr = lora["stages"]["train"]["config"], quick["stages"]["train"]["config"]["optim"]["lr"]
    assert train["lora"] == LoraConfig(rank=16, alpha=32).model_dump() and train["optim"]["lr"] == 10 * lr
    train["lora"], train["optim"]["lr"], lora["name"] = None, lr, "quickstart"
    assert lora == quick
