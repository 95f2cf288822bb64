"""molt.agents.evaluation and `molt eval`: pass@k, avg@k, maj@k and their standard errors; tasks; runs at a version."""

import asyncio
import json
import math

import pytest

from molt.runtime.checkpoint import checkpoint_at_version
from click.testing import CliRunner

from molt.commands import main
from molt.commands.eval import parse_task
from molt.agents import ChatTemplate
from molt.agents.evaluation import evaluate, load_problems, majority_score, pass_at_k, sampled_metrics, summarise
from molt.tasks.graders import ExactGrader, Grade, MathGrader, ShapesGrader
from molt.tasks import ArithmeticTask
from molt.runtime.metrics import logged_steps
from molt.runtime.pipeline import Pipeline
from molt.runtime.recording import read_batches
from molt.runtime.runner import Runner
from tests.conftest import run_spec
from tests.test_checkpoint import drop_checkpoints_after, resumable_rl
from tests.test_train import with_evaluation


def test_pass_at_k_is_chens_unbiased_estimator_by_hand():
    # n = 5 samples, c = 2 right: 1 - C(3, k) / C(5, k) = 1 - 3/5, 1 - 3/10, 1 - 1/10, 1 - 0, 1 - 0
    assert [pass_at_k(5, 2, k) for k in range(1, 6)] == pytest.approx([0.4, 0.7, 0.9, 1.0, 1.0])
    assert pass_at_k(5, 0, 3) == 0.0 and pass_at_k(5, 5, 1) == 1.0
    for bad in ((5, 6, 1), (5, 2, 0), (5, 2, 6)):
        with pytest.raises(ValueError, match="pass@k needs"):
            pass_at_k(*bad)


def test_the_majority_answer_decides_and_samples_without_an_answer_do_not_vote():
    assert majority_score([Grade(1.0, "5"), Grade(0.0, "6"), Grade(0.0, "6")]) == 0.0
    assert majority_score([Grade(0.0, None), Grade(0.0, None), Grade(1.0, "5")]) == 1.0
    assert majority_score([Grade(1.0, "5"), Grade(0.0, "6")]) == 1.0  # a tie: the answer seen first
    assert majority_score([Grade(0.0, "6"), Grade(1.0, "5")]) == 0.0
    assert majority_score([Grade(0.0, None)]) == 0.0


@pytest.mark.parametrize("grader, answer, samples", [
    (MathGrader(), "12", ["12", "12.0", "24/2", "13", "13"]),
    (MathGrader(), "18", ["$18.00", "so #### 18", "18.0", "17", "17"]),
    (ExactGrader(ignore_case=True), "Paris", ["Paris", "paris", "PARIS ", "Rome", "Rome"]),
    (ShapesGrader(), "3 red", ["3 red", "three RED", "3 red shapes", "4 red", "4 red"]),
], ids=["math", "gsm8k", "exact", "shapes"])
def test_maj_at_k_votes_by_the_graders_normal_form_as_its_score_does(grader, answer, samples):
    grades = [grader.grade(sample, answer) for sample in samples]
    assert [g.score for g in grades] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert sampled_metrics([grades])["maj@5"] == [1.0], "three right spellings outvote two wrong answers"
    assert len({g.extracted for g in grades[:3]}) == 1, "one answer in the grader's normal form"


def test_sampled_metrics_and_standard_errors_over_problems():
    right, wrong = Grade(1.0, "5"), Grade(0.0, "6")
    per = sampled_metrics([[right, wrong, wrong, wrong], [right, right, right, wrong]])
    assert per["pass@1"] == pytest.approx([0.25, 0.75]) and per["avg@4"] == pytest.approx([0.25, 0.75])
    assert per["pass@2"] == pytest.approx([0.5, 1.0]) and per["pass@4"] == [1.0, 1.0]
    assert per["maj@4"] == [0.0, 1.0]
    values = summarise(per)
    assert values["maj@4"] == 0.5 and values["maj@4_stderr"] == pytest.approx(math.sqrt(0.25 / 2))
    assert values["pass@4_stderr"] == 0.0
    # 0/1 values: the binomial standard error sqrt(p (1 - p) / N)
    assert summarise({"accuracy": [1.0, 0.0, 0.0, 0.0]})["accuracy_stderr"] == pytest.approx(math.sqrt(0.25 * 0.75 / 4))


def test_an_evaluation_grades_distinct_problems_all_of_a_small_split_and_its_stderr_counts_them(monkeypatch,
                                                                                               caplog):
    from types import SimpleNamespace

    # the quickstart's held-out split (operands 10-60, +) holds 261 problems; 500 asked
    task = ArithmeticTask(style="plain", min_operand=10, max_operand=60, num_problems=500, split="eval")
    with caplog.at_level("WARNING", logger="molt.agents.evaluation"):
        problems = load_problems(task, "stages.evaluate.config.task")
    asked = [(p["a"], p["b"]) for p in problems]
    assert len(asked) == len(set(asked)) == 261 and {p["split"] for p in problems} == {"eval"}
    assert "stages.evaluate.config.task.num_problems: 500; the task holds 261 distinct problems" in caplog.text
    fewer = load_problems(task.model_copy(update={"num_problems": 100}), "task")  # without replacement
    assert len({(p["a"], p["b"]) for p in fewer}) == 100 and fewer == problems[:100]
    with pytest.raises(ValueError, match="task: num_problems: an evaluation needs a number; got null"):
        load_problems(ArithmeticTask(split="eval", num_problems=None), "task")

    async def half_right(engine, chat, problems, *args):
        return [[Grade(float(i % 2), str(i))] for i in range(len(problems))]

    monkeypatch.setattr("molt.agents.evaluation.grade_samples", half_right)
    values = asyncio.run(evaluate(SimpleNamespace(policy_version=0), None, problems, MathGrader(),
                                  max_new_tokens=4, max_model_len=64))
    p = 130 / 261  # the standard error is of the 261 problems graded
    assert values["accuracy"] == pytest.approx(p) and values["accuracy_stderr"] == pytest.approx(math.sqrt(p * (1 - p) / 261))
    assert Pipeline.from_yaml("pipelines/quickstart.yaml").spec.results["eval_problems"] == "evaluate/num_problems"


def test_tasks_by_name_by_mapping_and_from_a_pipelines_evaluation():
    arith = parse_task("arithmetic")[0]["arithmetic"]
    assert (arith.task.split, arith.grader.type, arith.samples) == ("eval", "math", 1)
    assert parse_task("shapes")[0]["shapes"].grader.type == "shapes"
    assert parse_task("{type: shapes, split: eval}")[0]["shapes"].grader.type == "shapes"  # the task's grader
    mapped, _ = parse_task("{type: arithmetic, split: eval, num_problems: 7, max_new_tokens: 9, samples: 4, name: small}")
    assert (mapped["small"].task.num_problems, mapped["small"].max_new_tokens, mapped["small"].samples) == (7, 9, 4)
    tasks, pipe = parse_task("pipelines/quickstart.yaml")
    assert pipe is not None and list(tasks) == ["evaluate"] and tasks["evaluate"].task.num_problems == 261
    assert tasks["evaluate"].task.max_operand == 60
    assert tasks["evaluate"].max_new_tokens == pipe.stages["evaluate"].config.max_new_tokens
    with pytest.raises(ValueError, match="unknown task; hint: one of"):
        parse_task("arithmetics")
    with pytest.raises(ValueError, match=r"task\.num_probs: unknown key; did you mean 'num_problems'"):
        parse_task("{type: arithmetic, num_probs: 3}")
    with pytest.raises(ValueError, match="pipelines/smoke.yaml: the pipeline has no evaluation .no evaluation stage, no rollout with evaluate:."):
        parse_task("pipelines/smoke.yaml")


def molt(*args):
    """``molt ARGS`` in this process: the result's exit_code, stdout and stderr."""
    return CliRunner().invoke(main, [str(a) for a in args])


def test_molt_eval_of_a_run_at_a_version_is_the_eval_of_that_checkpoints_weights(full_rl_run, tmp_path):
    task = "{type: arithmetic, split: eval, num_problems: 4, max_new_tokens: 4}"
    common = ["--task", task, "--engine", "transformers", "--samples", "3", "--temperature", "1.0", "--seed", "1"]
    done = molt("eval", full_rl_run, "--version", "2", *common, "--json", tmp_path / "run.json")
    assert done.exit_code == 0, done.output
    report = json.loads((tmp_path / "run.json").read_text())
    folder, trainer = checkpoint_at_version(full_rl_run, {"source.0", "train.0"}, 2)
    assert report["policy_version"] == 2 and report["model"] == str(folder / trainer)
    values = report["tasks"]["arithmetic"]
    assert values["num_problems"] == 4 and values["seconds"] > 0
    assert {"accuracy", "pass@1", "pass@2", "pass@3", "avg@3", "maj@3"} <= values.keys()
    assert all(f"{k}_stderr" in values for k in ("accuracy", "pass@3", "maj@3"))
    printed = done.stdout
    assert "at version 2" in printed and "arithmetic: 4 problems, 3 samples at temperature 1" in printed
    assert "pass@3" in printed
    # the same weights evaluated as a model folder: the same greedy answers
    assert molt("eval", report["model"], "--task", task, "--engine", "transformers", "--json",
                tmp_path / "model.json").exit_code == 0
    alone = json.loads((tmp_path / "model.json").read_text())
    assert alone["policy_version"] is None and alone["tasks"]["arithmetic"]["accuracy"] == values["accuracy"]
    done = molt("eval", full_rl_run, "--version", "99", "--task", task)
    assert done.exit_code == 2
    assert "no complete checkpoint at step 99; got checkpoints at steps [0, 1, 2, 3, 4]" in done.stderr
    done = molt("eval", full_rl_run, "--samples", "4", "--temperature", "0")
    assert done.exit_code == 2 and "--temperature: takes more than 0; got 0.0" in done.stderr


def test_molt_eval_reads_an_agents_tool_calls_in_the_pipelines_format(tiny_chat_model, tmp_path):
    from pathlib import Path

    agent = tmp_path / "agent.yaml"  # the shipped agent's evaluation, in another tool-call format
    agent.write_text(f"base: {Path('pipelines/agent_tools.yaml').resolve()}\npolicy: {{tool_parser: mistral}}\n")
    done = molt("eval", tiny_chat_model, "--task", agent, "--engine", "transformers")
    assert done.exit_code == 2 and "policy.tool_parser: no tool parser 'mistral'" in done.stderr


def test_a_run_evaluates_several_tasks_each_at_its_interval_and_a_resume_repeats_none(tiny_chat_model, tmp_path,
                                                                                       no_orphans):
    spec = with_evaluation(resumable_rl(tiny_chat_model), tiny_chat_model)
    config = spec["stages"]["evaluate"]["config"]
    task = config.pop("task")
    config["tasks"] = {"arith": {"task": task, "max_new_tokens": 4},
                       "sampled": {"task": {**task, "num_problems": 4}, "max_new_tokens": 4, "samples": 2,
                                   "temperature": 1.0, "every_versions": 2}}
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    evaluated = logged_steps(tmp_path / "run" / "metrics" / "evaluate.0.jsonl")
    arith, sampled = evaluated["evaluate/arith/accuracy"], evaluated["evaluate/sampled/pass@2"]
    assert {0, 4} <= arith and {0, 4} <= sampled and sampled <= {0, 2, 3, 4}  # 3: 2 was waiting behind it
    assert "evaluate/arith/pass@2" not in evaluated and evaluated["evaluate/sampled/accuracy"] == sampled
    rows = [r for b in read_batches(tmp_path / "run" / "record" / "evaluate.out--eval_sink.in") for r in b.to_pylist()]
    assert sorted((r["task"], r["policy_version"]) for r in rows) == sorted(
        [("arith", v) for v in arith] + [("sampled", v) for v in sampled])
    # resumed from version 2 (barrier_5): versions up to 2 are not evaluated again, later ones are (new weights)
    drop_checkpoints_after(tmp_path / "run", 5)
    code = Runner(Pipeline.from_spec(spec), tmp_path / "run", live=False, resume=True).run()
    assert code == 0
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics" / "evaluate.0.jsonl").read_text().splitlines()]
    for key, first in (("evaluate/arith/accuracy", arith), ("evaluate/sampled/accuracy", sampled)):
        again = [rec["step"] for rec in lines if key in rec["values"]][len(first):]
        assert again and min(again) > 2 and max(again) == 4 and len(again) == len(set(again)), (key, again)
    assert sum("evaluate/arith/accuracy_baseline" in rec["values"] for rec in lines) == 1


def test_an_evaluation_on_the_rollouts_engine_is_of_one_version_in_no_trajectory_and_resumes(
        tiny_chat_model, tmp_path, no_orphans):
    """``evaluate:`` in the rollout: no second engine; each evaluation is of one version (refits wait for it;
    `grade_samples` fails the run otherwise); its requests are in no trajectory; the last version is evaluated
    after the trainer ends; a resume repeats none."""
    spec = resumable_rl(tiny_chat_model)
    task = {"type": "arithmetic", "split": "eval", "num_problems": 8}
    spec["stages"]["rollout"]["config"]["evaluate"] = {"every_versions": 2, "tasks": {
        "arith": {"task": task, "max_new_tokens": 4},
        "sampled": {"task": {**task, "num_problems": 4}, "max_new_tokens": 4, "samples": 2, "temperature": 1.0,
                    "every_versions": 4}}}
    spec["stages"]["eval_sink"] = {"class": "stages.metrics_sink.MetricsSink"}
    spec["edges"] = [{**e, "from": "rollout.out"} if e["from"] == "rollout" else e for e in spec["edges"]] + [
        {"from": "rollout.eval", "to": "eval_sink", "record": True}]  # two outputs: each edge names its own
    code, summary = run_spec(spec, tmp_path / "run")
    assert code == 0, summary.get("error")
    assert not any(p.name.startswith("evaluate") for p in (tmp_path / "run" / "metrics").iterdir())
    evaluated = logged_steps(tmp_path / "run" / "metrics" / "rollout.0.jsonl")
    arith, sampled = evaluated["rollout/eval/arith/accuracy"], evaluated["rollout/eval/sampled/pass@2"]
    assert arith == {0, 2, 4} and sampled == {0, 4}, "every 2 (4) versions, the last one (4) after the trainer ended"
    rows = [r for b in read_batches(tmp_path / "run" / "record" / "rollout.eval--eval_sink.in") for r in b.to_pylist()]
    assert sorted((r["task"], r["policy_version"]) for r in rows) == sorted(
        [("arith", v) for v in arith] + [("sampled", v) for v in sampled])
    trajectories = [r for b in read_batches(tmp_path / "run" / "record" / "rollout.out--reward.in") for r in b.to_pylist()]
    assert len(trajectories) == 8 * 2 and all(r["prompt_id"].startswith("arithmetic") for r in trajectories), \
        "the training prompts' groups, and no evaluation request"
    # resumed at version 2 (barrier_4): the evaluations whose rows the checkpoint holds are not repeated; those
    # whose rows went out after it, which the resume cuts from the recording, are, and later versions too
    drop_checkpoints_after(tmp_path / "run", 4)
    state = json.loads((tmp_path / "run" / "checkpoints" / "barrier_4" / "rollout.0.json").read_text())["state"]
    code = Runner(Pipeline.from_spec(spec), tmp_path / "run", live=False, resume=True).run()
    assert code == 0
    rows = [(r["task"], r["policy_version"]) for b in read_batches(tmp_path / "run" / "record" / "rollout.eval--eval_sink.in")
            for r in b.to_pylist()]
    assert sorted(rows) == sorted(set(rows)) and {("arith", v) for v in (0, 2, 4)} | {("sampled", 0), ("sampled", 4)} \
        <= set(rows), rows
    lines = [json.loads(line) for line in (tmp_path / "run" / "metrics" / "rollout.0.jsonl").read_text().splitlines()]
    again = [rec["step"] for rec in lines if "rollout/eval/arith/accuracy" in rec["values"]][len(arith):]
    assert again == [v for v in (0, 2, 4) if v not in state["evaluated"]["arith"]], (again, state)


def test_a_refit_waits_for_the_evaluation_on_its_engine_and_a_streamed_one_is_refused():
    """`Evaluator.refit`: while an evaluation runs a refit is put off (None at once), or, told to wait, held
    until it ends; an evaluation that failed fails the refit. Streamed refits cannot wait: refused."""
    from types import SimpleNamespace

    from molt.agents.evaluation import EvaluationConfig, Evaluator
    from molt.runtime.stage import StageContext

    stage = SimpleNamespace(ctx=StageContext("rollout"), engine=SimpleNamespace(policy_version=3))

    async def scenario():
        evaluator, held, refits = Evaluator(stage, None, "stages.rollout.config.evaluate", "eval"), asyncio.Event(), []

        async def refit():
            refits.append(stage.engine.policy_version)
            return 1.5

        evaluator.task = asyncio.ensure_future(held.wait())
        assert await evaluator.refit(refit, wait=False) is None and refits == []
        waiting = asyncio.ensure_future(evaluator.refit(refit, wait=True))
        await asyncio.sleep(0.05)
        assert not waiting.done() and refits == []
        held.set()
        assert await waiting == 1.5 and refits == [3]
        async def failing():
            raise RuntimeError("evaluation of version 3 failed")

        evaluator.task = asyncio.ensure_future(failing())
        with pytest.raises(RuntimeError, match="evaluation of version 3 failed"):
            await evaluator.refit(refit, wait=True)
        assert refits == [3]

    asyncio.run(scenario())
    stage.config = SimpleNamespace(engine=SimpleNamespace(transport=SimpleNamespace(type="nccl")))
    config = EvaluationConfig.model_validate({"task": {"type": "arithmetic", "split": "eval", "num_problems": 4}})
    with pytest.raises(ValueError, match=r"stages.rollout.config.evaluate: an evaluation holds the engine's refits, "
                                         r"and engine.transport nccl refits are streamed"):
        Evaluator(stage, config, "stages.rollout.config.evaluate", "eval")
    stage.ctx = StageContext("rollout", replica=1)
    assert Evaluator(stage, config, "stages.rollout.config.evaluate", "eval").tasks == {}, "replica 0 evaluates"


def test_an_evaluation_refuses_completions_of_another_version(tiny_chat_model):
    """The weights changed during an evaluation (a refit that did not wait for it): the evaluation fails."""
    from molt.engines.hf import TransformersEngine

    class Refitted(TransformersEngine):
        async def generate(self, *args, **kwargs):
            out = await super().generate(*args, **kwargs)
            self._version = 1  # new weights after the first completion
            return out

    engine = Refitted(str(tiny_chat_model))
    problems = load_problems(ArithmeticTask(split="eval", num_problems=3), "task")
    with pytest.raises(RuntimeError, match=r"eval-greedy: a completion holds tokens of version \[1\] in an "
                                           r"evaluation of version 0; the weights changed during it"):
        asyncio.run(evaluate(engine, ChatTemplate.for_model(tiny_chat_model), problems, MathGrader(),
                             max_new_tokens=4, max_model_len=256))
    engine.close()


def test_an_evaluation_takes_one_task_or_several_and_samples_need_a_temperature():
    from stages.evaluate import Evaluate

    task = {"type": "arithmetic", "split": "eval"}
    with pytest.raises(ValueError, match="give task .one. or tasks .several by name., not both or neither"):
        Evaluate.Config.model_validate({"task": task, "tasks": {"a": {"task": task}}})
    with pytest.raises(ValueError, match="tasks.a: samples > 1 need a temperature"):
        Evaluate.Config.model_validate({"tasks": {"a": {"task": task, "samples": 4}}})
