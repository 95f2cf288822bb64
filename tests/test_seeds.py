"""The run's seed: derived streams (molt.runtime.seeds), and what the pipeline's ``seed:`` changes."""

import json

from molt.runtime.pipeline import Pipeline
from molt.runtime.seeds import derive_seed
from molt.runtime.stage import StageContext
from stages.dataset_source import DatasetSource
from stages.synthetic_source import SyntheticSource


def test_derived_seeds_are_fixed_numbers_and_differ_by_every_part():
    assert derive_seed(0, "source", "shuffle") == 546844572739157402  # the same on every machine
    assert derive_seed(7, "q1/0") == 1647538678675258345  # the transformers engine's seed of request q1/0
    seeds = {derive_seed(s, stage, r) for s in (0, 1) for stage in ("rollout", "evaluate") for r in (0, 1)}
    assert len(seeds) == 8 and all(0 <= s < 2**63 for s in seeds)
    assert StageContext("rollout", seed=1).seed_for(0) == derive_seed(1, "rollout", 0)


def prompt_ids(run_seed, replica=0, num_replicas=1, **config):
    config = {"task": {"type": "arithmetic", "num_problems": 12}, "prompts_per_batch": 4, **config}
    s = DatasetSource(DatasetSource.Config.model_validate(config), StageContext("source", replica, num_replicas,
                                                                                seed=run_seed))
    s.setup()
    return [r["prompt_id"] for b in s.generate() for r in b.to_pylist()]


def test_the_run_seed_orders_the_dataset_and_an_explicit_source_seed_wins():
    assert prompt_ids(0) == prompt_ids(0) and sorted(prompt_ids(0)) == sorted(prompt_ids(1))
    assert prompt_ids(0) != prompt_ids(1)
    assert prompt_ids(0, seed=11) == prompt_ids(1, seed=11)
    shares = [prompt_ids(3, r, 2) for r in (0, 1)]  # replicas share one permutation: disjoint halves
    assert sorted(shares[0] + shares[1]) == sorted(prompt_ids(3))


def synthetic_groups(run_seed, **config):
    s = SyntheticSource(SyntheticSource.Config.model_validate({"num_groups": 4, **config}),
                        StageContext("source", seed=run_seed))
    s.setup()
    return [json.dumps(b.column("token_ids").to_pylist()) for b in s.generate()]


def test_the_run_seed_draws_the_synthetic_groups():
    assert synthetic_groups(0) == synthetic_groups(0) != synthetic_groups(1)
    assert synthetic_groups(0, seed=4) == synthetic_groups(1, seed=4)


def test_molt_run_seed_is_the_pipelines_top_level_seed():
    assert Pipeline.from_yaml("pipelines/smoke.yaml").spec.seed == 0
    assert Pipeline.from_yaml("pipelines/smoke.yaml", ["seed=3"]).spec.seed == 3


def test_a_resume_under_another_seed_is_refused_before_anything_starts(tmp_path):
    from click.testing import CliRunner

    from molt.commands import main

    (tmp_path / "pipeline.yaml").write_text("name: smoke\nseed: 3\n")
    done = CliRunner().invoke(main, ["run", "pipelines/smoke.yaml", "--resume", str(tmp_path)])
    assert done.exit_code == 2 and "the run has seed 3; got 0; hint: --seed 3" in done.stderr


def test_a_resume_of_another_pipeline_is_refused_naming_the_keys_that_differ(tmp_path):
    import yaml
    from click.testing import CliRunner

    from molt.commands import main

    (tmp_path / "pipeline.yaml").write_text(yaml.safe_dump(Pipeline.from_yaml("pipelines/smoke.yaml").to_dict()))
    done = CliRunner().invoke(main, ["run", "pipelines/smoke.yaml", "--set", "policy.temperature=0.5", "--resume",
                                     str(tmp_path)])
    assert done.exit_code == 2
    err = done.stderr
    assert "the pipeline differs from the run's" in err and "policy.temperature" in err, err
    assert f"molt run {tmp_path / 'pipeline.yaml'} --resume {tmp_path}" in err
