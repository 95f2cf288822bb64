import pyarrow as pa
import pytest

from molt.schema import (COLUMNS, SCHEMA_VERSION, TRAJECTORY_SCHEMA, WEIGHT_VERSION_SCHEMA,
                         batch_from_rows, conform, field_doc, make_schema, validate_batch)


def _row(**over):
    row = {"sample_id": "s0", "token_ids": [1, 2, 3], "loss_mask": [False, True, True]}
    row.update(over)
    return row


SMALL = make_schema([COLUMNS["sample_id"], COLUMNS["token_ids"], COLUMNS["loss_mask"]], "trajectory")


def test_trajectory_schema_carries_version_and_a_doc_for_every_column():
    assert TRAJECTORY_SCHEMA.metadata[b"molt.schema_version"] == SCHEMA_VERSION.encode()
    assert WEIGHT_VERSION_SCHEMA.metadata[b"molt.name"] == b"weight_version"
    for schema in (TRAJECTORY_SCHEMA, WEIGHT_VERSION_SCHEMA):
        for f in schema:
            assert field_doc(f), f"column {f.name} has no doc"
    for name in ("sample_id", "prompt_id", "rollout_id", "segment_index", "token_ids", "loss_mask",
                 "rollout_logprobs", "policy_version", "group_size", "score", "reward", "advantages",
                 "ref_logprobs", "teacher_logprobs", "values", "finish_reason", "metadata"):
        assert name in TRAJECTORY_SCHEMA.names
    assert TRAJECTORY_SCHEMA.field("token_ids").type == pa.list_(pa.int32())
    assert TRAJECTORY_SCHEMA.field("policy_version").type == pa.list_(pa.int32())


def test_batch_from_rows_builds_typed_columns():
    b = batch_from_rows([_row(), _row(sample_id="s1")], SMALL)
    assert b.num_rows == 2 and b.schema.field("token_ids").type == pa.list_(pa.int32())
    assert b.schema.metadata[b"molt.schema_version"] == SCHEMA_VERSION.encode()


def test_batch_from_rows_names_the_row_and_column_of_a_bad_value():
    with pytest.raises(ValueError, match=r"column 'token_ids', row 1: cannot convert"):
        batch_from_rows([_row(), _row(token_ids=["x"])], SMALL)


def test_batch_from_rows_names_missing_and_unknown_columns():
    with pytest.raises(ValueError, match=r"row 0: .*missing \['loss_mask'\], unknown \['los_mask'\]"):
        batch_from_rows([{"sample_id": "a", "token_ids": [1], "los_mask": [True]}], SMALL)


def test_validate_batch_rejects_a_per_token_column_of_the_wrong_length():
    b = batch_from_rows([_row(), _row(loss_mask=[True])], SMALL)
    with pytest.raises(ValueError, match=r"edge x: column 'loss_mask', row 1: length 1 != len\(token_ids\) 3"):
        validate_batch(b, SMALL, "edge x")


def test_validate_batch_names_a_missing_column():
    b = batch_from_rows([_row()], SMALL).drop_columns(["loss_mask"])
    with pytest.raises(ValueError, match=r"missing columns \['loss_mask'\]"):
        validate_batch(b, SMALL, "edge x")


def test_a_duplicated_column_is_refused_naming_it_and_the_edge():
    schema = make_schema([*SMALL, COLUMNS["reward"]], "trajectory")
    b = batch_from_rows([_row(reward=1.0)], schema)
    twice = b.append_column(COLUMNS["reward"], pa.array([0.0], pa.float32()))  # a second 'reward'
    with pytest.raises(ValueError, match=r"edge x: batch does not match schema 'trajectory': duplicated columns "
                                         r"\['reward'\]"):
        validate_batch(twice, schema, "edge x")
    with pytest.raises(ValueError, match=r"output s\.out: .*duplicated columns \['reward'\]"):
        conform(twice, schema, "output s.out")


def test_conform_reorders_columns_and_rejects_wrong_types():
    b = batch_from_rows([_row()], SMALL)
    shuffled = b.select(["loss_mask", "sample_id", "token_ids"])
    assert conform(shuffled, SMALL, "here").schema.names == SMALL.names
    wrong = pa.RecordBatch.from_pydict({"sample_id": [1], "token_ids": [[1]], "loss_mask": [[True]]})
    with pytest.raises(ValueError, match=r"column 'sample_id' is int64, expected string"):
        conform(wrong, SMALL, "here")
