"""YAML/Python -> validated Pipeline, and every load-time error."""

import textwrap

import pytest
import yaml

from molt.pipeline import Pipeline

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
     r"stages.knobs.class: .* is not a molt.stage.Stage subclass"),
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
