"""The pipeline's policy block (molt.policy): model, precision, temperature, the step's groups, the
staleness bound and the weights' publication stated once, for the trainer and every engine alike; a
contradiction fails or warns at load, naming both keys."""

import logging

import pytest

from molt.runtime.pipeline import Pipeline

QUICKSTART = "pipelines/quickstart.yaml"


def facts(pipe):
    """stage -> (temperature, precision) of the stages that hold them."""
    out = {}
    for sid, n in pipe.stages.items():
        c = n.config
        precision = getattr(c, "compute_dtype", None) or getattr(getattr(c, "engine", None), "dtype", None)
        if precision is not None:
            out[sid] = (getattr(c, "temperature", None), precision)
    return out


def test_the_policy_block_sets_the_trainers_and_every_engines_precision_and_temperature():
    assert facts(Pipeline.from_yaml(QUICKSTART)) == {
        "rollout": (0.8, "float32"), "train": (0.8, "float32"), "evaluate": (None, "float32")}
    assert "policy: model smollm2-135m-instruct, precision float32, temperature 0.8" in Pipeline.from_yaml(QUICKSTART).describe()  # molt graph
    pipe = Pipeline.from_yaml(QUICKSTART, ["policy.precision=bfloat16", "policy.temperature=1.1"])
    assert facts(pipe) == {"rollout": (1.1, "bfloat16"), "train": (1.1, "bfloat16"), "evaluate": (None, "bfloat16")}
    saved = pipe.to_dict()  # a run's pipeline.yaml states the facts once, in its policy block
    assert "temperature" not in saved["stages"]["train"]["config"] and "dtype" not in saved["stages"]["rollout"][
        "config"]["engine"] and saved["policy"] == {
        "model": "smollm2-135m-instruct", "precision": "bfloat16", "temperature": 1.1, "groups_per_step": 16,
        "max_staleness": 1}
    assert facts(Pipeline.from_spec(saved)) == facts(pipe)
    saved["policy"]["temperature"] = 0.7  # e.g. molt replay RUN_DIR --from-step K --set policy.temperature=0.7
    assert facts(Pipeline.from_spec(saved))["train"] == (0.7, "bfloat16")


def test_a_temperature_that_contradicts_another_fails_at_load_naming_both_keys():
    with pytest.raises(ValueError, match=r"quickstart.yaml \(with --set .*\): stages.train.config.temperature is 1.0 "
                                         r"but policy.temperature is 0.8; .*hint: state it once, as policy.temperature"):
        Pipeline.from_yaml(QUICKSTART, ["stages.train.config.temperature=1.0"])
    with pytest.raises(ValueError, match="stages.train.config.temperature is 1.0 but "
                                         "stages.rollout.config.temperature is 0.8"):
        Pipeline.from_yaml(QUICKSTART, ["policy.temperature=null", "stages.rollout.config.temperature=0.8",
                                        "stages.train.config.temperature=1.0"])
    with pytest.raises(ValueError, match=r"stages.train.config.weights.keep_versions is 3 but "
                                         r"policy.weights.keep_versions is 1; hint"):  # down to the field that differs
        Pipeline.from_yaml(QUICKSTART, ["policy.weights={keep_versions: 1}", "stages.train.config.weights={keep_versions: 3}"])
    agreed = Pipeline.from_yaml(QUICKSTART, ["policy.temperature=null", "stages.rollout.config.temperature=0.7"])
    assert facts(agreed)["train"][0] == 0.7, "the one stated value holds for the trainer too"
    assert facts(Pipeline.from_yaml(QUICKSTART, ["policy.temperature=null"]))["train"][0] == 1.0, "unstated: 1.0"
    with pytest.raises(ValueError, match=r"stages.train.config.temperature: Input should be greater than 0; got 0.0 "
                                         r"from stages.rollout.config.temperature"):  # greedy rollouts cannot train
        Pipeline.from_yaml(QUICKSTART, ["policy.temperature=null", "stages.rollout.config.temperature=0"])


def test_a_stage_in_another_precision_loads_with_a_warning_of_what_it_costs(caplog):
    with caplog.at_level(logging.WARNING, logger="molt.policy"):
        pipe = Pipeline.from_yaml(QUICKSTART, ["stages.train.config.compute_dtype=bfloat16"])
    assert facts(pipe) == {"rollout": (0.8, "float32"), "train": (0.8, "bfloat16"), "evaluate": (None, "float32")}
    [warning] = [r.getMessage() for r in caplog.records]
    assert "stages.train.config.compute_dtype is bfloat16 but policy.precision is float32" in warning
    assert "ratio max 1.38" in warning and "correction (TIS/IcePop)" in warning
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="molt.policy"):
        Pipeline.from_yaml(QUICKSTART, ["stages.train.config.compute_dtype=float32"])
    assert not caplog.records, "stating the policy's own value is no contradiction"


def test_the_policy_states_the_model_the_step_the_staleness_bound_and_the_weights_once():
    pipe = Pipeline.from_yaml(QUICKSTART)
    c = {sid: n.config for sid, n in pipe.stages.items()}
    assert c["rollout"].model == c["train"].model == c["evaluate"].model == "smollm2-135m-instruct"
    assert c["rollout"].groups_per_step == c["pack"].groups_per_step == 16
    assert c["rollout"].max_staleness == c["train"].max_staleness == 1
    pipe = Pipeline.from_yaml(QUICKSTART, ["policy.model=m", "policy.groups_per_step=4", "policy.max_staleness=0",
                                           "policy.weights={keep_versions: 1}"])
    c = {sid: n.config for sid, n in pipe.stages.items()}
    assert {c["rollout"].model, c["train"].model, c["evaluate"].model} == {"m"}
    assert (c["pack"].groups_per_step, c["rollout"].max_staleness, c["train"].weights.keep_versions) == (4, 0, 1)
    strict = Pipeline.from_yaml(QUICKSTART, ["stages.rollout.config.max_staleness=0"])  # admits more strictly
    assert (strict.stages["rollout"].config.max_staleness, strict.stages["train"].config.max_staleness) == (0, 1)
    free = Pipeline.from_yaml(QUICKSTART, ["stages.rollout.config.max_staleness=null"])  # the trainer's bound holds
    assert (free.stages["rollout"].config.max_staleness, free.stages["train"].config.max_staleness) == (None, 1)
    for key, message in [("stages.evaluate.config.model=other", "stages.evaluate.config.model is other but "
                          "policy.model is smollm2-135m-instruct"),
                         ("stages.pack.config.groups_per_step=8", "stages.pack.config.groups_per_step is 8 but "
                          "policy.groups_per_step is 16"),
                         ("stages.train.config.max_staleness=2", "stages.train.config.max_staleness is 2 but "
                          "policy.max_staleness is 1"),
                         ("stages.rollout.config.max_staleness=2", r"stages.rollout.config.max_staleness is 2 but "
                          r"policy.max_staleness is 1 \(a rollout may admit only more strictly\)")]:
        with pytest.raises(ValueError, match=message + ".*hint: state it once"):
            Pipeline.from_yaml(QUICKSTART, [key])


def test_rollout_replicas_each_pace_their_share_of_the_steps_groups():
    from molt.agents.admission import GroupAdmission

    assert GroupAdmission(64, 1, replicas=4).groups_per_step == 16
    with pytest.raises(ValueError, match=r"stages.rollout.config.groups_per_step: 10 groups a step do not split "
                                         r"evenly among 4 rollout replicas"):
        GroupAdmission(10, 1, 4, "stages.rollout.config.groups_per_step")
