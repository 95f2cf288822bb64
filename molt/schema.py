"""The wire: Arrow schemas of every record that crosses an edge.

One row of the trajectory record is one trajectory segment (DESIGN §3). Shapes use
``T`` = number of tokens of the row's whole sequence (prompt + completion + env
tokens), ``L`` = MoE layers, ``K`` = experts per token.

Every column is declared once, here, with its Arrow type and a one-line doc; stages
name the columns they read and write, and the pipeline checks each edge at load.
A column has one owner (the stage that adds it); later stages add new columns
instead of rewriting old ones.
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
    _field("rollout_id", pa.string(), "id of the rollout (episode) this segment belongs to"),
    _field("segment_index", pa.int32(), "index of this segment within its rollout, from 0"),
    _field("token_ids", _I32_LIST, "[T] exact engine token ids of the whole sequence"),
    _field("loss_mask", pa.list_(pa.bool_()), "[T] true exactly on tokens the policy generated"),
    _field("rollout_logprobs", _F32_LIST,
           "[T] logprob (nats) each generated token was sampled with, after temperature; "
           "0 where loss_mask is false"),
    _field("policy_version", _I32_LIST,
           "[T] optimizer steps in the weights that generated each token; -1 for prompt, "
           "tool and environment tokens"),
    _field("group_size", pa.int32(), "number of rollouts the rollout stage started for this prompt"),
    _field("score", pa.float32(), "raw task score from the grader or env (never rewritten)"),
    _field("reward", pa.float32(), "reward used for advantages: score after shaping"),
    _field("advantages", _F32_LIST, "[T] per-token advantage; 0 where loss_mask is false"),
    _field("ref_logprobs", _F32_LIST, "[T] logprob (nats) of each token under the reference model"),
    _field("teacher_logprobs", _F32_LIST, "[T] logprob (nats) of each token under a teacher"),
    _field("values", _F32_LIST, "[T] critic value estimate at each token"),
    _field("finish_reason", pa.string(), "why generation stopped: stop, length, abort, error, ..."),
    _field("images", pa.list_(pa.binary()), "encoded images (PNG/JPEG bytes) of the row, in order; null: none"),
    _field("image_token_positions", _I32_LIST,
           "[total image tokens] positions in token_ids of the images' tokens, which the model's "
           "processor expanded from one placeholder each, as many as each image has (molt.models.images)"),
    _field("routed_experts", pa.binary(),
           "[T, L, K] int16 (little-endian, C order) expert ids the engine routed each token to "
           "(routing replay), -1 where it routed none; L, K: the policy's MoE layers and top-k; written by a "
           "rollout with engine.record_routing: true"),
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
    _field("policy_version", pa.int32(), "optimizer steps in these weights (0 = initial checkpoint)"),
    _field("uri", pa.string(),
           "where the weights are: file:///dev/shm/... (safetensors), nccl://group, cuda-ipc://..."),
    _field("format", pa.string(), "safetensors | nccl | cuda_ipc"),
    _field("num_bytes", pa.int64(), "total size of the tensor bytes (bytes)"),
    _field("tensor_names", pa.list_(pa.string()), "[N] Hugging Face names of every exported tensor"),
    _field("tensor_digests", pa.list_(pa.string()),
           "[N] digest of each tensor's dtype, shape and bytes (molt.refit.tensor_digest), "
           "in tensor_names order; the engine recomputes them as it loads (refit verification)"),
    _field("tensor_dtypes", pa.list_(pa.string()), "[N] torch dtype of each tensor without 'torch.' (float32, "
           "bfloat16), in tensor_names order: a streamed transfer (format nccl) sizes its buffers by them"),
    _field("tensor_shapes", pa.list_(pa.list_(pa.int64())), "[N][rank] shape of each tensor, tensor_names order"),
    _field("probe_token_ids", _I32_LIST,
           "[P] fixed probe token ids (molt.refit), the same every version; empty = no probe"),
    _field("probe_logprobs", _F32_LIST,
           "[P-1] the trainer's log_softmax(logits)[x_t] of probe token t given those before it, "
           "temperature 1, t = 1..P-1; the engine's must match within probe_atol after the refit"),
    _field("probe_atol", pa.float32(),
           "largest |engine - trainer| probe logprob difference accepted (nats); null without a probe"),
    _field("created_unix_s", pa.float64(), "when the export finished (seconds since epoch)"),
)

DROP_NOTICE_FIELDS: tuple[pa.Field, ...] = (
    _field("filter_replica", pa.int32(), "replica of the group filter that sends the notice"),
    _field("num_groups_dropped", pa.int64(),
           "groups that replica has dropped so far, since the run began (a running count: a late or repeated "
           "notice changes nothing; molt.agents.admission)"),
)


def make_schema(fields: Iterable[pa.Field], name: str) -> pa.Schema:
    """Build a named schema carrying ``molt.schema_version`` and ``molt.name`` metadata."""
    return pa.schema(list(fields), metadata={VERSION_KEY: SCHEMA_VERSION.encode(),
                                             b"molt.name": name.encode()})


TRAJECTORY_SCHEMA = make_schema(TRAJECTORY_FIELDS, "trajectory")
WEIGHT_VERSION_SCHEMA = make_schema(WEIGHT_VERSION_FIELDS, "weight_version")
DROP_NOTICE_SCHEMA = make_schema(DROP_NOTICE_FIELDS, "drop_notice")


def field_doc(field: pa.Field) -> str:
    """The one-line doc of a field ('' if none)."""
    return (field.metadata or {}).get(b"doc", b"").decode()


def resolve_fields(columns: Sequence[str | pa.Field], where: str) -> list[pa.Field]:
    """Turn column names (trajectory columns) or custom fields into fields.

    Raises:
        ValueError: a name that is not a trajectory column, naming ``where``.
    """
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
    """Build a record batch from Python dicts, one per row.

    Every field of ``schema`` must be a key of every row (use None for null);
    extra keys are an error, so a typo never vanishes silently.

    Example: ``batch_from_rows([{"x": 1}], pa.schema([("x", pa.int64())]))`` -> 1 row.

    Raises:
        ValueError: naming the row index and the column that is missing, unknown or
            of the wrong type.
    """
    names = schema.names
    for i, row in enumerate(rows):
        missing = [n for n in names if n not in row]
        extra = [k for k in row if k not in schema.names]
        if missing or extra:
            raise ValueError(f"row {i}: columns do not match schema {schema_name(schema)!r}; "
                             f"missing {missing}, unknown {extra}")
    arrays = []
    for f in schema:
        try:
            arrays.append(pa.array([r[f.name] for r in rows], type=f.type))
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError) as e:
            bad = _first_bad_row(rows, f)
            raise ValueError(f"column {f.name!r}, row {bad}: cannot convert "
                             f"{rows[bad][f.name]!r} to {f.type}; {e}") from None
    return pa.RecordBatch.from_arrays(arrays, schema=schema)


def _first_bad_row(rows: Sequence[Mapping[str, Any]], f: pa.Field) -> int:
    for i, r in enumerate(rows):
        try:
            pa.array([r[f.name]], type=f.type)
        except (pa.ArrowInvalid, pa.ArrowTypeError, TypeError, OverflowError):
            return i
    return 0


def schema_name(schema: pa.Schema) -> str:
    return (schema.metadata or {}).get(b"molt.name", b"?").decode()


def schema_diff(expected: pa.Schema, got: pa.Schema) -> str:
    """Describe how ``got`` differs from ``expected`` ('' when names and types agree)."""
    exp = {f.name: f.type for f in expected}
    have = {f.name: f.type for f in got}
    parts = []
    if missing := [n for n in exp if n not in have]:
        parts.append(f"missing columns {missing}")
    if extra := [n for n in have if n not in exp]:
        parts.append(f"unexpected columns {extra}")
    parts += [f"column {n!r} is {have[n]}, expected {t}"
              for n, t in exp.items() if n in have and have[n] != t]
    return "; ".join(parts)


def validate_batch(batch: pa.RecordBatch, schema: pa.Schema, where: str) -> None:
    """Check a batch against a schema and the per-token length rule.

    Raises:
        ValueError: ``where`` plus the column (and row) at fault.
    """
    if diff := schema_diff(schema, batch.schema):
        raise ValueError(f"{where}: batch does not match schema {schema_name(schema)!r}: {diff}")
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
    """Reorder a batch's columns to ``schema`` and attach its metadata.

    Raises:
        ValueError: when names or types differ (see :func:`schema_diff`).
    """
    if diff := schema_diff(schema, batch.schema):
        raise ValueError(f"{where}: batch does not match schema {schema_name(schema)!r}: {diff}")
    if batch.schema.names != schema.names:
        batch = batch.select(schema.names)
    return pa.RecordBatch.from_arrays(batch.columns, schema=schema)

