"""The shapes task: seeded pictures, split safety, pixels that match the answer, grader and env."""

import io
from collections import Counter

import pytest
from pydantic import TypeAdapter, ValidationError

from molt.agents.shapes_env import RETRY, ShapesEnv
from molt.tasks.graders import Grade, GraderConfig, ShapesGrader, parse_count_colour
from molt.models.images import decode_image_part
from molt.tasks.configs import ShapesTask, TaskConfig
from molt.tasks.shapes import COLOURS, QUESTION, ShapeProblems, canonical

Image = pytest.importorskip("PIL.Image")  # drawing needs Pillow


def records(n, **kw):
    task = ShapeProblems(**kw)
    return [task.record(i) for i in range(n)]


def png_of(record):
    image_part, text_part = record["messages"][0]["content"]
    assert text_part == {"type": "text", "text": QUESTION}
    return decode_image_part(image_part, record["prompt_id"])


def blobs(image):
    """Connected components (8-neighbour) of non-white pixels: a list of {(x, y): rgb}."""
    width, height = image.size
    pixels = image.load()
    seen, found = set(), []
    for start in ((x, y) for y in range(height) for x in range(width)):
        if start in seen or pixels[start] == (255, 255, 255):
            continue
        blob, todo = {}, [start]
        seen.add(start)
        while todo:
            x, y = todo.pop()
            blob[(x, y)] = pixels[x, y]
            for nx in (x - 1, x, x + 1):
                for ny in (y - 1, y, y + 1):
                    if 0 <= nx < width and 0 <= ny < height and (nx, ny) not in seen \
                            and pixels[nx, ny] != (255, 255, 255):
                        seen.add((nx, ny))
                        todo.append((nx, ny))
        found.append(blob)
    return found


def test_a_record_and_its_png_bytes_are_the_same_on_every_call_and_depend_on_the_seed():
    assert records(20, seed=3) == records(20, seed=3)
    pngs = [png_of(r) for r in records(20, seed=3)]
    assert pngs == [png_of(r) for r in records(20, seed=3)]
    assert pngs != [png_of(r) for r in records(20, seed=4)]
    assert all(p.startswith(b"\x89PNG") for p in pngs)


def test_a_record_has_the_documented_form():
    r = ShapeProblems().record(0)
    assert set(r) == {"prompt_id", "messages", "answer", "task", "split", "count", "colour", "shapes"}
    assert r["prompt_id"] == "shapes-train-s0-0" and r["task"] == "shapes" and r["split"] == "train"
    assert r["answer"] == f"{r['count']} {r['colour']}" and len(r["shapes"]) == r["count"]
    assert r["messages"][0]["role"] == "user" and r["messages"][0]["content"][0]["image"].startswith(
        "data:image/png;base64,")


def test_train_and_eval_splits_never_share_a_scene_whatever_the_seed():
    def scenes(n, **kw):
        return {canonical(r["colour"], r["shapes"]) for r in records(n, **kw)}

    train = scenes(1000, seed=0) | scenes(1000, seed=1)
    held_out = scenes(1000, seed=0, split="eval") | scenes(1000, seed=7, split="eval")
    assert len(train) > 1900 and len(held_out) > 1900
    assert not train & held_out
    assert canonical("red", [("square", 30, 4, 16), ("circle", 2, 9, 14)]) == "red|circle@2,9,14|square@30,4,16"


def test_the_picture_shows_as_many_blobs_as_the_count_all_in_the_answer_colour():
    rs = records(160, seed=5)
    assert {r["count"] for r in rs} == {1, 2, 3, 4} and {r["colour"] for r in rs} == set(COLOURS)
    for r in rs:
        image = Image.open(io.BytesIO(png_of(r)))
        assert image.size == (64, 64) and image.mode == "RGB"
        found = blobs(image)
        assert len(found) == r["count"], r["prompt_id"]
        colours = Counter(rgb for blob in found for rgb in blob.values())
        assert set(colours) == {COLOURS[r["colour"]]}, r["prompt_id"]
        for blob in found:
            xs, ys = [x for x, _ in blob], [y for _, y in blob]
            assert 14 <= max(max(xs) - min(xs), max(ys) - min(ys)) + 1 <= 20


def test_the_shape_count_follows_the_options_and_answers_are_near_uniform():
    assert {r["count"] for r in records(60, min_shapes=2, max_shapes=3)} == {2, 3}
    answers = Counter(r["answer"] for r in records(1600, seed=2))
    assert len(answers) == 16 and max(answers.values()) < 2 * 1600 / 16


@pytest.mark.parametrize("completion, score", [
    ("3 red", 1.0),
    ("There are three red shapes.", 1.0),
    ("THREE Red", 1.0),
    ("3 blue", 0.0),
    ("2 red", 0.0),
    ("red", 0.0),
    ("3", 0.0),
    ("", 0.0),
])
def test_shapes_grader_scores_exactly(completion, score):
    assert ShapesGrader().grade(completion, "3 red").score == score


def test_shapes_grader_reports_what_it_read_and_is_selected_by_type():
    assert ShapesGrader().grade("I see three red ones", "3 red") == Grade(1.0, "3 red")
    assert ShapesGrader().grade("only blue", "3 red") == Grade(0.0, "blue")
    assert ShapesGrader().grade("no idea", "3 red") == Grade(0.0, None)
    assert parse_count_colour("the 3rd is Yellow") == (None, "yellow")
    assert isinstance(TypeAdapter(GraderConfig).validate_python({"type": "shapes"}), ShapesGrader)


def test_the_env_gives_one_retry_then_ends():
    task = ShapeProblems(seed=1).record(0)
    count, colour = task["count"], task["colour"]
    wrong_colour = next(c for c in COLOURS if c != colour)
    env = ShapesEnv()
    assert env.reset(task) == task["messages"]
    first = env.step(f"{count} {wrong_colour}")
    assert (first.reward, first.terminated, first.observation) == (0.0, False, RETRY)
    assert first.info == {"count_right": True, "colour_right": False}
    second = env.step(f"{count % 4 + 1} {wrong_colour}")
    assert (second.reward, second.terminated) == (0.0, True)
    assert second.info == {"count_right": False, "colour_right": False}
    env.reset(task)
    env.step("no idea")
    right = env.step(f"{count} {colour.upper()}")
    assert (right.reward, right.terminated, right.info) == (1.0, True, {"count_right": True, "colour_right": True})
    env.reset(task)
    assert env.step(task["answer"]).reward == 1.0 and env.num_tries == 1


def test_shapes_config_loads_through_the_task_union_and_checks_its_range():
    task = TypeAdapter(TaskConfig).validate_python({"type": "shapes", "seed": 2, "split": "eval",
                                                    "num_problems": 5, "max_shapes": 2})
    assert isinstance(task, ShapesTask)
    loaded = task.load()
    assert loaded.num_records == 5 and loaded.record(0) == ShapeProblems(seed=2, split="eval", max_shapes=2).record(0)
    assert ShapesTask(num_problems=None).load().num_records is None
    with pytest.raises(ValidationError, match="min_shapes must be <= max_shapes; got 3 > 2"):
        ShapesTask(min_shapes=3, max_shapes=2)
    with pytest.raises(ValidationError, match="max_shapes"):
        ShapesTask(max_shapes=5)
