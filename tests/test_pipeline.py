"""YAML/Python -> validated Pipeline, and every load-time error."""

import textwrap

import pytest
import yaml

from molt.runtime.pipeline import Pipeline

SRC = "stages.synthetic_source.SyntheticSource"
SINK = "stages.metrics_sink.MetricsSink"


def write(tmp_path, text, name="p.yaml"):
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


GOOD = """\
    name: t
    stages:
      source: {class: stages.synthetic_source.SyntheticSource, config: {num_groups: 2}}
      knobs: {class: tests.doubles.stages.Knobs, config: {temperature: 0.7}}
    edges:
      - {from: source, to: knobs}
"""


def test_yaml_and_python_build_the_same_pipeline(tmp_path):
    from stages.synthetic_source import SyntheticSource
    from tests.doubles.stages import Knobs

    from_yaml = Pipeline.from_yaml(write(tmp_path, GOOD))
    from_python = Pipeline.from_spec({
        "name": "t",
        "stages": {"source": {"class": SyntheticSource, "config": {"num_groups": 2}},
                   "knobs": {"class": Knobs, "config": {"temperature": 0.7}}},
        "edges": [{"from": "source", "to": "knobs"}]})
    assert from_yaml.to_dict() == from_python.to_dict()
    assert [e.schema for e in from_yaml.edges] == [e.schema for e in from_python.edges]


def test_a_saved_pipeline_keeps_each_stages_cpus_and_gpus():
    """A run's pipeline.yaml (to_dict) is what --resume and `molt replay` run: a trainer moved off its one
    CPU would run two threads, and on an AVX-512 CPU a replay no longer repeats the run's loss."""
    for path in ("pipelines/quickstart.yaml", "pipelines/gsm8k_gpu.yaml"):
        pipe = Pipeline.from_yaml(path)
        saved = Pipeline.from_spec(yaml.safe_load(yaml.safe_dump(pipe.to_dict())))
        assert {s: (n.cpus, n.gpus) for s, n in saved.stages.items()} == {
            s: (n.cpus, n.gpus) for s, n in pipe.stages.items()}
    assert Pipeline.from_yaml("pipelines/quickstart.yaml", ["stages.train.cpus=1"]).to_dict()["stages"]["train"][
        "cpus"] == "1", "--set stages.train.cpus=1 (a YAML int) names CPU 1"


def test_set_overrides_a_nested_value(tmp_path):
    pipe = Pipeline.from_yaml(write(tmp_path, GOOD), ["stages.knobs.config.max_new_tokens=32"])
    assert pipe.stages["knobs"].config.max_new_tokens == 32


ERRORS = [
    # (yaml text, expected error regex)
    (GOOD.replace("temperature: 0.7", "temprature: 0.7"),
     r"p.yaml: stages.knobs.config.temprature: unknown key; did you mean 'temperature'\?"),
    (GOOD.replace("temperature: 0.7", "max_new_tokens: lots"),
     r"p.yaml: stages.knobs.config.max_new_tokens: Input should be a valid integer.*got 'lots'"),
    (GOOD.replace("max_new_tokens", "x").replace("temperature: 0.7", "max_new_tokens: 0"),
     r"stages.knobs.config.max_new_tokens: Input should be greater than or equal to 1"),
    (GOOD.replace("name: t", "nmae: t"), r"p.yaml: nmae: unknown key; did you mean 'name'\?"),
    (GOOD.replace("{from: source, to: knobs}", "{from: source, to: knobs, kind: strem}"),
     r"edges\[0\].kind: Input should be 'stream', 'keyed' or 'broadcast'"),
    (GOOD.replace("{from: source, to: knobs}", "{from: source, to: knobs, recrod: true}"),
     r"edges\[0\].recrod: unknown key; did you mean 'record'\?"),
    (GOOD.replace("tests.doubles.stages.Knobs", "tests.doubles.stages.Knbos"),
     r"stages.knobs.class: module 'tests.doubles.stages' has no class 'Knbos'; did you mean 'Knobs'\?"),
    (GOOD.replace("tests.doubles.stages.Knobs", "nowhere.Knobs"),
     r"stages.knobs.class: cannot import module 'nowhere'"),
    (GOOD.replace("tests.doubles.stages.Knobs", "molt.schema.COLUMNS"),
     r"stages.knobs.class: .* is not a molt.runtime.stage.Stage subclass"),
    (GOOD + "      - {from: source, to: knobz}\n",
     r"edges\[1\].to: unknown stage 'knobz'; did you mean 'knobs'\?"),
    (GOOD.replace("knobs: {", "Knobs2: {").replace("to: knobs", "to: Knobs2"),
     r"stages.Knobs2: stage id 'Knobs2' must be snake_case"),
    (GOOD.replace("      knobs:", "      source: {class: x.Y}\n      knobs:"),
     r"duplicate key 'source'"),
    (GOOD.replace("    edges:\n      - {from: source, to: knobs}\n", "    edges: []\n"),
     r"stages.knobs: input 'in' has no edge"),
    (GOOD.replace("tests.doubles.stages.Knobs", "tests.doubles.stages.NeedsAdvantages")
     .replace("config: {temperature: 0.7}", "config: {}"),
     r"edge source.out->knobs.in: stage 'knobs' reads column 'advantages' which no upstream stage writes"),
    ("stages: {a: {class: stages.synthetic_source.SyntheticSource}}\n",
     r"stages.a: output 'out' has no edge, its rows would be lost"),
    ("stages: [1, 2]\n", r"p.yaml: stages: Input should be a valid dictionary"),
    ("stages:\n  a: {class: x\n", r"p.yaml: invalid YAML"),
]


@pytest.mark.parametrize("text,error", ERRORS)
def test_bad_pipelines_fail_at_load_naming_the_file_and_path(tmp_path, text, error):
    with pytest.raises(ValueError, match=error):
        Pipeline.from_yaml(write(tmp_path, text))


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(ValueError, match=r"nope.yaml: pipeline file not found"):
        Pipeline.from_yaml(tmp_path / "nope.yaml")


CYCLE = """\
    stages:
      source: {class: stages.synthetic_source.SyntheticSource}
      actor: {class: tests.doubles.stages.Actor}
      learner: {class: tests.doubles.stages.Learner}
      sink: {class: stages.metrics_sink.MetricsSink}
    edges:
      - {from: source, to: actor.in}
      - {from: actor, to: learner}
      - {from: learner.out, to: sink}
      - {from: learner.weights, to: actor.weights, kind: broadcast%s}
"""


def test_an_undeclared_cycle_is_refused_and_a_declared_feedback_edge_is_accepted(tmp_path):
    with pytest.raises(ValueError, match=r"cycle among stages \['actor', 'learner'\] is not declared; hint: mark "
                                         r"the one edge .* \(one of: edges\[1\] actor -> learner, "
                                         r"edges\[3\] learner -> actor\)"):
        Pipeline.from_yaml(write(tmp_path, CYCLE % ""))
    pipe = Pipeline.from_yaml(write(tmp_path, CYCLE % ", feedback: true"))
    assert pipe.topo_order() == ["source", "actor", "learner", "sink"]
    assert "feedback" in pipe.describe()


def test_an_ambiguous_port_must_be_named(tmp_path):
    text = (CYCLE % ", feedback: true").replace("{from: source, to: actor.in}", "{from: source, to: actor}")
    with pytest.raises(ValueError, match=r"stage 'actor' has inputs \['in', 'weights'\]; name one as 'actor.PORT'"):
        Pipeline.from_yaml(write(tmp_path, text))


def test_a_keyed_edge_needs_its_key_column(tmp_path):
    text = GOOD.replace("{from: source, to: knobs}", "{from: source, to: knobs, kind: keyed, key: group}")
    with pytest.raises(ValueError, match=r"edges\[0\].key: column 'group' is not on edge source.out->knobs.in"):
        Pipeline.from_yaml(write(tmp_path, text))


def test_a_stage_may_not_rewrite_a_column_it_receives(tmp_path):
    text = GOOD.replace("tests.doubles.stages.Knobs", "stages.shape_reward.ShapeReward").replace(
        "config: {temperature: 0.7}", "config: {}") + """\
      shape2: {class: stages.shape_reward.ShapeReward}
      sink: {class: stages.metrics_sink.MetricsSink}
""".replace("      ", "    ", 0)
    text = textwrap.dedent(text).replace("edges:\n  - {from: source, to: knobs}\n", "")
    text += "edges:\n  - {from: source, to: knobs}\n  - {from: knobs, to: shape2}\n  - {from: shape2, to: sink}\n"
    path = tmp_path / "p.yaml"
    path.write_text(text.replace("  shape2", "  shape2").replace("\n  sink", "\n  sink"))
    with pytest.raises(ValueError, match=r"writes column 'reward' which already arrives on its input"):
        Pipeline.from_yaml(path)


def test_the_smoke_pipeline_loads_and_draws_itself():
    pipe = Pipeline.from_yaml("pipelines/smoke.yaml")
    text = pipe.describe()
    assert "source.out->shape.in" in text and "keyed(prompt_id)" in text and "record" in text
    first = open("pipelines/smoke.yaml").readline()
    assert first.startswith("# molt run pipelines/smoke.yaml")


def test_set_reaches_list_items_and_errors_name_the_override(tmp_path):
    path = write(tmp_path, GOOD)
    assert Pipeline.from_yaml(path, ["edges.0.capacity=9"]).edges[0].cfg.capacity == 9
    assert Pipeline.from_yaml(path, ["edges[0].hwm=7"]).edges[0].cfg.hwm == 7
    with pytest.raises(ValueError, match=r"--set edges.3.capacity: edges.3: no such list index \(the list has 1"):
        Pipeline.from_yaml(path, ["edges.3.capacity=1"])
    with pytest.raises(ValueError, match=r"p.yaml \(with --set edges.0.capacity=0\): edges\[0\].capacity: "
                                         r"Input should be greater than or equal to 1"):
        Pipeline.from_yaml(path, ["edges.0.capacity=0"])


def test_a_pipeline_names_a_base_and_states_only_what_differs(tmp_path):
    """molt.config.load_yaml: mappings merge key by key (of one ``type``), a stage set to null goes with its
    edges, a circle of bases is refused; moe.yaml is the quickstart with a MoE policy."""
    quick, moe = Pipeline.from_yaml("pipelines/quickstart.yaml"), Pipeline.from_yaml("pipelines/moe.yaml")
    assert moe.stages["train"].config.model == moe.stages["evaluate"].config.model == "smollm2-135m-instruct-moe"
    assert moe.stages["rollout"].config.engine.kv_cache_gib == 0.75 and moe.stages["rollout"].config.engine.block_size \
        == quick.stages["rollout"].config.engine.block_size == 32, "merged key by key"
    assert moe.stages["train"].config.weights.keep_versions == 1 and moe.stages["train"].config.routing_replay
    assert moe.stages["source"].config == quick.stages["source"].config and moe.spec.results == quick.spec.results
    assert [e.name for e in moe.edges] == [e.name for e in quick.edges]
    base = tmp_path / "base.yaml"
    base.write_text(open("pipelines/quickstart.yaml").read())
    derived = write(tmp_path, """\
        base: base.yaml
        name: derived
        keep_checkpoints: null                 # a null value is a value (keep every checkpoint)
        stages:
          source:
            config: {task: {type: gsm8k, path: data/gsm8k/train.jsonl}}   # another type: replaced whole
          evaluate: null
          eval_sink: null
    """, "derived.yaml")
    pipe = Pipeline.from_yaml(derived)
    assert pipe.spec.name == "derived" and pipe.spec.keep_checkpoints is None
    assert pipe.stages["source"].config.task.type == "gsm8k" and pipe.stages["source"].config.prompts_per_batch == 16
    assert "evaluate" not in pipe.stages and not any("evaluate" in e.name for e in pipe.edges)
    write(tmp_path, "base: loop_b.yaml\nname: a\n", "loop_a.yaml")
    write(tmp_path, "base: loop_a.yaml\nname: b\n", "loop_b.yaml")
    with pytest.raises(ValueError, match=r"loop_b.yaml: base: loop_a.yaml leads back to a file that names it"):
        Pipeline.from_yaml(tmp_path / "loop_a.yaml")
    write(tmp_path, "base: nope.yaml\nname: a\n", "lost.yaml")
    with pytest.raises(ValueError, match=r"lost.yaml: base: 'nope.yaml' is not a pipeline file \(a path relative to"):
        Pipeline.from_yaml(tmp_path / "lost.yaml")
    write(tmp_path, "base: base.yaml\nstages: {evalute: null}\n", "typo.yaml")
    with pytest.raises(ValueError, match=r"typo.yaml: stages.evalute: null removes a stage of the base, and base.yaml "
                                         r"has no stage 'evalute'; stages: \[.*'evaluate'"):
        Pipeline.from_yaml(tmp_path / "typo.yaml")


def test_molt_graph_resolved_prints_the_pipeline_as_it_loads(tmp_path):
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-m", "molt", "graph", "pipelines/moe.yaml", "--resolved"],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    resolved = yaml.safe_load(out.stdout)
    assert "base" not in resolved and resolved["policy"]["model"] == "smollm2-135m-instruct-moe"
    assert "model" not in resolved["stages"]["train"]["config"], "the policy's facts are stated once"
    again, moe = Pipeline.from_spec(resolved), Pipeline.from_yaml("pipelines/moe.yaml")
    assert {sid: n.config for sid, n in again.stages.items()} == {sid: n.config for sid, n in moe.stages.items()}


def test_a_pipeline_written_for_the_broadcast_stage_is_refused_with_the_way_over(tmp_path):
    path = write(tmp_path, """\
        stages:
          broadcast: {class: stages.broadcast.Broadcast, colocate_with: train}
        edges: []
    """)
    with pytest.raises(ValueError, match=r"stages.broadcast: Value error, the broadcast stage \(colocate_with: train\) "
                                         r"is gone: the train stage publishes its own weights; hint: .*train.weights"):
        Pipeline.from_yaml(path)
    with pytest.raises(ValueError, match=r"quickstart.yaml \(with --set .*\): stages.train.config.publish.weights: "
                                         r"an output of its own"):
        Pipeline.from_yaml("pipelines/quickstart.yaml", ["stages.train.config.publish={weights: {}}"])


def test_the_pack_stage_plans_for_the_world_size_of_the_train_stage_it_feeds():
    """Rows planned for a rank the trainer lacks would never train: the pack's world_size follows the train
    stage's, and a pack stating another is refused naming both keys."""
    pipe = Pipeline.from_yaml("pipelines/grpo_arithmetic.yaml", ["stages.train.world_size=1"])
    assert pipe.stages["pack"].config.world_size == 1
    assert Pipeline.from_yaml("pipelines/grpo_arithmetic.yaml").stages["pack"].config.world_size == 2
    with pytest.raises(ValueError, match=r"stages.pack.config.world_size is 2 but stages.train.world_size is 1: "
                                         r"rows planned for a missing rank would never train; hint: leave"):
        Pipeline.from_yaml("pipelines/quickstart.yaml", ["stages.pack.config.world_size=2"])


def test_an_unknown_key_under_a_tagged_task_names_that_task_type_s_keys():
    """pydantic puts the union's tag (``arithmetic``) in an error's path; the path the user reads and
    the keys offered are those of the task type the YAML chose."""
    with pytest.raises(ValueError, match=r"stages\.source\.config\.task\.max_opernd: unknown key; "
                                         r"did you mean 'max_operand'\?"):
        Pipeline.from_yaml("pipelines/quickstart.yaml", ["stages.source.config.task.max_opernd=3"])
    with pytest.raises(ValueError, match=r"stages\.source\.config\.task\.zz: unknown key; valid keys: "
                                         r"\[.*'min_operand'.*\]"):
        Pipeline.from_yaml("pipelines/quickstart.yaml", ["stages.source.config.task.zz=3"])
