"""The wire: Arrow schemas of every record that crosses an edge, each column declared once
with its type and doc, and owned by the stage that adds it.

A trajectory row is one segment (DESIGN §3); ``T`` = tokens of its whole sequence (prompt,
completion and env tokens), ``L`` = MoE layers, ``K`` = experts per token.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import pyarrow as pa

SCHEMA_VERSION = "1"
VERSION_KEY = b"molt.schema_version"


def _field(name: str, type_: pa.DataType, doc: str) -> pa.Field:
    return pa.field(name, type_, nullable=True, metadata={b"doc": doc.encode()})


_I32_LIST = pa.list_(pa.int32())
_F32_LIST = pa.list_(pa.float32())

TRAJECTORY_FIELDS: tuple[pa.Field, ...] = (
    _field("sample_id", pa.string(), "unique id of this row"),
    _field("prompt_id", pa.string(), "group key: rows from the same prompt form one group"),
    _field("rollout_id", pa.string(), "id of the rollout (episode) of this segment"),
    _field("segment_index", pa.int32(), "index of this segment within its rollout, from 0"),
    _field("token_ids", _I32_LIST, "[T] exact engine token ids of the whole sequence"),
    _field("loss_mask", pa.list_(pa.bool_()), "[T] true exactly on tokens the policy generated"),
    _field("rollout_logprobs", _F32_LIST, "[T] logprob (nats) each generated token was "
           "sampled with, after temperature; 0 where loss_mask is false"),
    _field("policy_version", _I32_LIST, "[T] optimizer steps in the weights that generated "
           "each token; -1 for prompt, tool and environment tokens"),
    _field("group_size", pa.int32(), "rollouts the rollout stage started for this prompt"),
    _field("score", pa.float32(), "raw task score from the grader or env (never rewritten)"),
    _field("reward", pa.float32(), "reward used for advantages: score after shaping"),
    _field("advantages", _F32_LIST, "[T] per-token advantage; 0 where loss_mask is false"),
    _field("ref_logprobs", _F32_LIST, "[T] logprob (nats) of each token under the reference"),
    _field("teacher_logprobs", _F32_LIST, "[T] logprob (nats) of each token under a teacher"),
    _field("values", _F32_LIST, "[T] critic value estimate at each token"),
    _field("finish_reason", pa.string(), "why generation stopped: stop, length, abort, error, ..."),
    _field("images", pa.list_(pa.binary()), "encoded images (PNG/JPEG bytes); null: none"),
    _field("image_token_positions", _I32_LIST, "[total image tokens] positions in token_ids of "
           "the images' tokens, each image's placeholder expanded (molt.models.images)"),
    _field("routed_experts", pa.binary(), "[T, L, K] int16 (little-endian, C order) expert ids "
           "the engine routed each token to, -1 for none (engine.record_routing: true)"),
    _field("metadata", pa.string(), "JSON object: task fields, labels, diagnostics"),
)

#: Every trajectory column by name.
COLUMNS: dict[str, pa.Field] = {f.name: f for f in TRAJECTORY_FIELDS}

#: Columns whose list length must equal ``len(token_ids)`` in every row.
PER_TOKEN_COLUMNS = frozenset(
    {"loss_mask", "rollout_logprobs", "policy_version", "advantages",
     "ref_logprobs", "teacher_logprobs", "values"}
)

WEIGHT_VERSION_FIELDS: tuple[pa.Field, ...] = (
    _field("policy_version", pa.int32(), "optimizer steps in these weights (0 = initial)"),
    _field("uri", pa.string(), "where the weights are: file:///dev/shm/... or nccl://..."),
    _field("format", pa.string(), "safetensors | nccl | cuda_ipc"),
    _field("num_bytes", pa.int64(), "total size of the tensors (bytes)"),
    _field("tensor_names", pa.list_(pa.string()), "[N] Hugging Face names of the tensors"),
    _field("tensor_digests", pa.list_(pa.string()), "[N] molt.refit.tensor_digest of each "
           "tensor"),
    _field("tensor_dtypes", pa.list_(pa.string()), "[N] dtype of each tensor (float32, "
           "bfloat16): nccl sizes its buffers by them"),
    _field("tensor_shapes", pa.list_(pa.list_(pa.int64())), "[N][rank] shape of each tensor"),
    _field("probe_token_ids", _I32_LIST, "[P] the refit probe's token ids (molt.refit); "
           "empty = no probe"),
    _field("probe_logprobs", _F32_LIST, "[P-1] the trainer's logprob of probe token t given "
           "those before it, t = 1..P-1 (molt.refit)"),
    _field("probe_atol", pa.float32(), "largest |engine - trainer| probe logprob difference "
           "accepted (nats); null without a probe"),
    _field("created_unix_s", pa.float64(), "when the export finished (seconds since epoch)"),
)

DROP_NOTICE_FIELDS: tuple[pa.Field, ...] = (
    _field("filter_replica", pa.int32(), "replica of the group filter that sends the notice"),
    _field("num_groups_dropped", pa.int64(), "groups that replica has dropped since the run "
           "began: a running count, so a late or repeated notice changes nothing"),
)


def make_schema(fields: Iterable[pa.Field], name: str) -> pa.Schema:
    """A schema with ``molt.schema_version`` and ``molt.name`` metadata."""
    return pa.schema(list(fields), metadata={VERSION_KEY: SCHEMA_VERSION.encode(),
                                             b"molt.name": name.encode()})


TRAJECTORY_SCHEMA = make_schema(TRAJECTORY_FIELDS, "trajectory")
WEIGHT_VERSION_SCHEMA = make_schema(WEIGHT_VERSION_FIELDS, "weight_version")
DROP_NOTICE_SCHEMA = make_schema(DROP_NOTICE_FIELDS, "drop_notice")


def field_doc(field: pa.Field) -> str:
    """The one-line doc of a field ('' if none)."""
    return (field.metadata or {}).get(b"doc", b"").decode()


def resolve_fields(columns: Sequence[str | pa.Field], where: str) -> list[pa.Field]:
    """Fields of trajectory column names or custom fields; ValueError for an unknown name."""
    out = []
    for c in columns:
        if isinstance(c, pa.Field):
            out.append(c)
        elif c in COLUMNS:
            out.append(COLUMNS[c])
        else:
            raise ValueError(f"{where}: unknown column {c!r}; hint: declare it as a pyarrow "
                             f"field or use one of {sorted(COLUMNS)}")
    return out


def batch_from_rows(rows: Sequence[Mapping[str, Any]], schema: pa.Schema) -> pa.RecordBatch:
    """A record batch of dicts, one per row, each with exactly the keys of ``schema`` (None
    for null); ValueError naming the row and the column missing, unknown or of a wrong type."""
    names = schema.names
    for i, row in enumerate(rows):
        missing = [n for n in names if n not in row]
        extra = [k for k in row if k not in names]
        if missing or extra:
            raise ValueError(f"row {i}: columns do not match schema {schema_name(schema)!r}; "
                             f"missing {missing}, unknown {extra}")
    arrays = []
    for f in schema:
        try:
            arrays.append(pa.array([r[f.name] for r in rows], type=f.type))
        except _CONVERT_ERRORS as e:
            bad = _first_bad_row(rows, f)
            raise ValueError(f"column {f.name!r}, row {bad}: cannot convert "
                             f"{rows[bad][f.name]!r} to {f.type}; {e}") from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


_CONVERT_ERRORS = (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError)


def _first_bad_row(rows: Sequence[Mapping[str, Any]], f: pa.Field) -> int:
    for i, r in enumerate(rows):
        try:
            pa.array([r[f.name]], type=f.type)
        except _CONVERT_ERRORS:
            return i
    return 0


def schema_name(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"molt.name", b"?").decode()


def schema_diff(expected: pa.Schema, got: pa.Schema) -> str:
    """How ``got`` differs from ``expected`` ('' when names and types agree, each name once)."""
    exp = {f.name: f.type for f in expected}
    have = {f.name: f.type for f in got}
    parts = []
    if twice := sorted({n for n in got.names if got.names.count(n) > 1}):
        parts.append(f"duplicated columns {twice}")
    if missing := [n for n in exp if n not in have]:
        parts.append(f"missing columns {missing}")
    if extra := [n for n in have if n not in exp]:
        parts.append(f"unexpected columns {extra}")
    parts += [f"column {n!r} is {have[n]}, expected {t}"
              for n, t in exp.items() if n in have and have[n] != t]
    return "; ".join(parts)


def _check_schema(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> None:
    if diff := schema_diff(schema, batch.schema):
        raise ValueError(f"{where}: batch does not match schema {schema_name(schema)!r}: {diff}")


def validate_batch(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> None:
    """ValueError naming ``where`` and the column (and row) unless ``batch`` has the columns
    of ``schema`` and per-token columns as long as token_ids."""
    _check_schema(batch, schema, where)
    if "token_ids" not in batch.schema.names:
        return
    lengths = batch.column("token_ids").value_lengths().to_pylist()
    for name in PER_TOKEN_COLUMNS & set(batch.schema.names):
        col_lengths = batch.column(name).value_lengths().to_pylist()
        for row, (n, m) in enumerate(zip(lengths, col_lengths)):
            if m is not None and n is not None and m != n:
                raise ValueError(f"{where}: column {name!r}, row {row}: length {m} != "
                                 f"len(token_ids) {n}; hint: per-token columns are [T]")


def conform(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> pa.RecordBatch:
    """``batch`` in the column order and with the metadata of ``schema`` (else ValueError)."""
    _check_schema(batch, schema, where)
    if batch.schema.names != schema.names:
        batch = batch.select(schema.names)
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)

