"""YAML or Python -> one validated `Pipeline` (stages, ports, edges, schemas).

A pipeline file::

    name: smoke
    stages:
      source: {class: stages.synthetic_source.SyntheticSource, config: {num_groups: 8}}
      shape:  {class: stages.shape_reward.ShapeReward, replicas: 2}
      sink:   {class: stages.metrics_sink.MetricsSink}
    edges:
      - {from: source, to: shape, kind: keyed}
      - {from: shape, to: sink, record: true}

Everything is checked before any process starts: keys and types, classes, configs, dangling
edges, cycles not closed by a ``feedback: true`` edge, and the columns each consumer reads.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa

from molt.config import apply_override, beside, check_requires, import_class, load_yaml, validate
from molt.policy import apply_policy, filled
from molt.runtime.placement import check_placement, parse_ids
from molt.runtime.spec import FOLLOWS_WORLD_SIZE, EdgeConfig, PipelineSpec, StageSpec
from molt.runtime.stage import Port, Stage, StageConfig
from molt.runtime.targets import check_metric_keys
from molt.schema import make_schema, resolve_fields

_ID = re.compile(r"^[a-z][a-z0-9_]*$")


@dataclass
class StageNode:
    """A validated stage."""

    id: str
    cls: type[Stage]
    class_path: str
    config: StageConfig
    replicas: int
    world_size: int
    inputs: dict[str, Port]
    outputs: dict[str, Port]
    cpus: list[int] | None = None
    gpus: list[int] | None = None


@dataclass
class Edge:
    """A validated edge and the schema of what it carries."""

    index: int
    src: str
    src_port: str
    dst: str
    dst_port: str
    cfg: EdgeConfig
    schema: pa.Schema | None = None

    @property
    def name(self) -> str:
        return f"{self.src}.{self.src_port}->{self.dst}.{self.dst_port}"


class Pipeline:
    """The validated graph, built by `from_yaml` or `from_spec`."""

    def __init__(self, spec: PipelineSpec, source: str, stages: dict[str, StageNode],
                 edges: list[Edge]) -> None:
        self.spec, self.source, self.stages, self.edges = spec, source, stages, edges

    @classmethod
    def from_yaml(cls, path: str | Path, overrides: list[str] | None = None) -> Pipeline:
        """Load, apply ``--set key=value`` overrides, and validate.

        Raises:
            ValueError: naming the file and the dotted path of the first problem.
        """
        path = Path(path)
        data = load_yaml(path)
        for item in overrides or []:
            apply_override(data, item, str(path))
        beside(data, path)  # `requires:` files are relative to this one
        source = str(path) + (f" (with --set {' '.join(overrides)})" if overrides else "")
        return cls.from_spec(data, source=source)

    @classmethod
    def from_spec(cls, data: dict[str, Any] | PipelineSpec, source: str = "<python>") -> Pipeline:
        """Validate a dict (YAML shape) or a `PipelineSpec`; a ``class`` may be a class."""
        if isinstance(data, PipelineSpec):
            data = data.model_dump(by_alias=True)
        spec = validate(PipelineSpec, data, source, ())
        check_requires(spec.requires, source)
        stages = {sid: _build_stage(sid, s, source) for sid, s in spec.stages.items()}
        apply_policy(spec.policy, {sid: n.config for sid, n in stages.items()}, source)
        edges = [_build_edge(i, e, stages, source) for i, e in enumerate(spec.edges)]
        pipe = cls(spec, source, stages, edges)
        _follow_world_size(pipe)
        _check_graph(pipe)
        return pipe

    def preflight(self) -> None:
        """Every stage's `Stage.preflight` (datasets and files).

        Raises:
            ValueError: the first problem, naming the stage's config key.
        """
        for sid, n in self.stages.items():
            n.cls.preflight(n.config, f"{self.source}: stages.{sid}.config")

    def to_dict(self) -> dict[str, Any]:
        """The resolved pipeline as plain data, placement included (a trainer's thread count
        changes its floating-point sums)."""
        data = self.spec.model_dump(by_alias=True, exclude={"stages"})
        data["policy"] = self.spec.policy.model_dump(mode="json", exclude_none=True)
        data["stages"] = {}
        for sid, n in self.stages.items():
            ids = {k: ",".join(map(str, v)) for k, v in (("cpus", n.cpus), ("gpus", n.gpus))
                   if v is not None}
            config = n.config.model_dump(mode="json", exclude=filled(n.config))  # policy: once
            data["stages"][sid] = {"class": n.class_path, "replicas": n.replicas,
                                   "world_size": n.world_size, "config": config, **ids}
        return data

    def checkpointed(self) -> dict[str, int]:
        """Stages a barrier reaches (id -> replicas): the sources and all downstream of them over
        non-broadcast edges."""
        reached = {sid for sid, n in self.stages.items() if not n.inputs}
        while new := {e.dst for e in self.edges
                      if e.src in reached and e.cfg.kind != "broadcast"} - reached:
            reached |= new
        return {sid: n.replicas for sid, n in self.stages.items() if sid in reached}

    def topo_order(self) -> list[str]:
        """Stage ids so that producers come before consumers (feedback edges ignored)."""
        deps = {s: {e.src for e in self.edges if e.dst == s and not e.cfg.feedback}
                for s in self.stages}
        order: list[str] = []
        while len(order) < len(deps):
            ready = [s for s in deps if s not in order and deps[s] <= set(order)]
            if not ready:
                raise ValueError(self._cycle_error(set(deps) - set(order)))
            order.extend(sorted(ready))
        return order

    def _cycle_error(self, left: set[str]) -> str:
        """Name the stages on a cycle (not those merely downstream of one) and its edges."""
        on_cycle = set(left)
        while True:  # drop stages that feed nothing on the cycle
            inner = [e for e in self.edges
                     if e.src in on_cycle and e.dst in on_cycle and not e.cfg.feedback]
            if {e.src for e in inner} == on_cycle:
                break
            on_cycle = {e.src for e in inner}
        edges = [f"edges[{e.index}] {e.src} -> {e.dst}" for e in inner]
        return (f"{self.source}: edges: cycle among stages {sorted(on_cycle)} is not declared; "
                f"hint: mark the one edge that closes it `feedback: true` (one of: "
                f"{', '.join(edges)})")

    def describe(self) -> str:
        """The resolved DAG as text (``molt graph``)."""
        spec = self.spec
        facts = spec.policy.model_dump(exclude_none=True, exclude={"weights"})
        lines = [f"pipeline {spec.name!r} ({self.source})",
                 "policy: " + ", ".join(f"{k} {v}" for k, v in facts.items()),
                 *[f"requires: {name} (made by {file})" for name, file in spec.requires.items()],
                 "stages:"]
        for sid in self.topo_order():
            n = self.stages[sid]
            kind = f"torchrun group x{n.world_size}" if n.world_size > 1 else "process"
            lines.append(f"  {sid:<14} {n.class_path}  replicas={n.replicas}  [{kind}]")
        lines.append("edges:")
        for e in self.edges:
            flags = [e.cfg.kind + (f"({e.cfg.key})" if e.cfg.kind == "keyed" else "")]
            flags += [f for f, on in (("feedback", e.cfg.feedback), ("record", e.cfg.record)) if on]
            cols = ", ".join(e.schema.names) if e.schema is not None else ""
            lines.append(f"  {e.name:<40} {' '.join(flags):<24} [{cols}]")
        return "\n".join(lines)


def _build_stage(sid: str, s: StageSpec, source: str) -> StageNode:
    where = f"{source}: stages.{sid}"
    if not _ID.match(sid):
        raise ValueError(f"{where}: stage id {sid!r} must be snake_case ([a-z][a-z0-9_]*)")
    cls = s.class_ if isinstance(s.class_, type) else import_class(str(s.class_), f"{where}.class")
    if not (isinstance(cls, type) and issubclass(cls, Stage)):
        raise ValueError(f"{where}.class: {cls!r} is not a molt.runtime.stage.Stage subclass")
    config = validate(cls.Config, s.config, source, ("stages", sid, "config"))
    try:
        inputs, outputs = cls.ports(config)
    except ValueError as e:
        raise ValueError(f"{where}.config.{e}") from None
    cpus = None if s.cpus is None else parse_ids(str(s.cpus), f"{where}.cpus")
    gpus = None if s.gpus is None else parse_ids(str(s.gpus), f"{where}.gpus")
    if gpus is not None and len(gpus) % s.replicas:
        raise ValueError(f"{where}.gpus: {len(gpus)} GPUs do not split evenly among {s.replicas} "
                         "replicas")
    return StageNode(sid, cls, f"{cls.__module__}.{cls.__qualname__}", config, s.replicas,
                     s.world_size, inputs, outputs, cpus, gpus)


def _endpoint(ref: str, stages: dict[str, StageNode], out: bool, where: str) -> tuple[str, str]:
    sid, _, port = ref.partition(".")
    if sid not in stages:
        close = difflib.get_close_matches(sid, list(stages), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else f"; stages: {sorted(stages)}"
        raise ValueError(f"{where}: unknown stage {sid!r}{hint}")
    ports = stages[sid].outputs if out else stages[sid].inputs
    if not port:
        if len(ports) != 1:
            raise ValueError(f"{where}: stage {sid!r} has {'outputs' if out else 'inputs'} "
                             f"{sorted(ports)}; name one as '{sid}.PORT'")
        port = next(iter(ports))
    if port not in ports:
        raise ValueError(f"{where}: stage {sid!r} has no {'output' if out else 'input'} {port!r}; "
                         f"it has {sorted(ports)}; hint: some ports exist only when the stage's "
                         "config turns them on (weights_input, drops_input, notify_drops)")
    return sid, port


def _build_edge(i: int, e: EdgeConfig, stages: dict[str, StageNode], source: str) -> Edge:
    src, sp = _endpoint(e.from_, stages, True, f"{source}: edges[{i}].from")
    dst, dp = _endpoint(e.to, stages, False, f"{source}: edges[{i}].to")
    return Edge(i, src, sp, dst, dp, e)


def _follow_world_size(pipe: Pipeline) -> None:
    """A config field marked FOLLOWS_WORLD_SIZE takes the ``world_size`` of the stage fed."""
    for sid, n in pipe.stages.items():
        fields = type(n.config).model_fields.items()
        for name in (k for k, f in fields if f.json_schema_extra == FOLLOWS_WORLD_SIZE):
            for dst in sorted({e.dst for e in pipe.edges if e.src == sid}):
                have, ranks = getattr(n.config, name), pipe.stages[dst].world_size
                if name not in n.config.model_fields_set:
                    setattr(n.config, name, ranks)
                elif have != ranks:
                    raise ValueError(
                        f"{pipe.source}: stages.{sid}.config.{name} is {have} but "
                        f"stages.{dst}.world_size is {ranks}: rows planned for a missing rank would "
                        f"never train; hint: leave stages.{sid}.config.{name} out, it follows "
                        f"stages.{dst}.world_size")


def _check_graph(pipe: Pipeline) -> None:
    src = pipe.source
    for sid, n in pipe.stages.items():
        for port in n.inputs:
            if not any(e.dst == sid and e.dst_port == port for e in pipe.edges):
                raise ValueError(f"{src}: stages.{sid}: input {port!r} has no edge; hint: add "
                                 f"{{from: PRODUCER, to: {sid}.{port}}} under edges")
    for sid, n in pipe.stages.items():
        for port, p in n.outputs.items():
            if not p.optional and not any(e.src == sid and e.src_port == port for e in pipe.edges):
                raise ValueError(f"{src}: stages.{sid}: output {port!r} has no edge, its rows would "
                                 "be lost; hint: connect it to a consumer (a sink)")
    for sid in pipe.topo_order():
        _check_inputs(pipe, sid)
        for e in (e for e in pipe.edges if e.src == sid):
            e.schema = _output_schema(pipe, sid, e.src_port)
            if e.cfg.kind == "keyed" and e.cfg.key not in e.schema.names:
                raise ValueError(f"{src}: edges[{e.index}].key: column {e.cfg.key!r} is not on "
                                 f"edge {e.name}; it carries {e.schema.names}")
    for sid in pipe.stages:  # feedback inputs, now that every schema is known
        _check_inputs(pipe, sid)
    check_group_filters(pipe)
    ranks = {sid: n.world_size for sid, n in pipe.stages.items()}
    check_placement(pipe.spec.placement, ranks, src)
    check_metric_keys(pipe.spec.stop_when, pipe.spec.keep_best, pipe.stages, src)


def check_group_filters(pipe: Pipeline) -> None:
    """Refuse a group filter downstream of a ``max_staleness`` bound whose ``drops`` do not reach
    the bounded stage over a broadcast edge (it would wait for a dropped group forever), or of
    more than one bounded replica (a notice does not say which one made the group)."""
    for sid, n in pipe.stages.items():
        if not n.cls.drops_groups:
            continue
        upstream: set[str] = set()
        frontier = {sid}
        while frontier := {e.src for e in pipe.edges
                           if e.dst in frontier and not e.cfg.feedback} - upstream:
            upstream |= frontier
        bounds = {up: getattr(pipe.stages[up].config, "max_staleness", None) for up in sorted(upstream)}
        bounded = {up: bound for up, bound in bounds.items() if bound is not None}
        for up, bound in bounded.items():
            notices = (sid, "drops", up, "drops", "broadcast")
            if not any((e.src, e.src_port, e.dst, e.dst_port, e.cfg.kind) == notices for e in pipe.edges):
                raise ValueError(
                    f"{pipe.source}: stages.{sid} drops whole groups, downstream of stages.{up}, "
                    f"which admits groups under stages.{up}.config.max_staleness {bound}: without "
                    f"notices of the drops it counts a dropped group as trained and would wait for a "
                    f"version that never comes; hint: stages.{sid}.config.notify_drops: true, "
                    f"stages.{up}.config.drops_input: true and the edge {{from: {sid}.drops, to: "
                    f"{up}.drops, kind: broadcast, feedback: true}}")
        if (replicas := sum(pipe.stages[up].replicas for up in bounded)) > 1:
            raise ValueError(
                f"{pipe.source}: stages.{sid} drops whole groups made by {replicas} rollout replicas "
                f"under a max_staleness bound ({', '.join(f'stages.{u}' for u in bounded)}): a drop "
                "notice does not say which one made the group; hint: one bounded replica, or "
                "max_staleness: null (the train stage still refuses stale tokens)")


def _output_schema(pipe: Pipeline, sid: str, port: str) -> pa.Schema:
    node, where = pipe.stages[sid], f"{pipe.source}: stages.{sid} output {port!r}"
    p = node.outputs[port]
    if p.schema is not None:
        return p.schema
    fields: list[pa.Field] = []
    if p.passes is not None:
        incoming = [e.schema for e in pipe.edges if e.dst == sid and e.dst_port == p.passes]
        fields = list(incoming[0]) if incoming and incoming[0] is not None else []
    names = {f.name for f in fields}
    for f in resolve_fields(p.writes, where):
        if f.name in names:
            raise ValueError(f"{where}: writes column {f.name!r} which already arrives on its input; "
                             "hint: a column has one owner; add a new column instead")
        fields.append(f)
    return make_schema(fields, "trajectory")


def _check_inputs(pipe: Pipeline, sid: str) -> None:
    node = pipe.stages[sid]
    for port, p in node.inputs.items():
        schemas = [(e, e.schema) for e in pipe.edges if e.dst == sid and e.dst_port == port]
        known = [(e, s) for e, s in schemas if s is not None]
        if not known:
            continue
        first_edge, first = known[0]
        for e, s in known[1:]:
            if not s.equals(first, check_metadata=False):
                raise ValueError(f"{pipe.source}: edges {first_edge.name} and {e.name} into "
                                 f"{sid}.{port} carry different columns: {first.names} vs {s.names}")
        have = {f.name: f.type for f in first}
        for f in resolve_fields(p.reads, f"{pipe.source}: stages.{sid} input {port!r}"):
            if f.name not in have:
                doc = (f.metadata or {}).get(b"doc", b"").decode()
                raise ValueError(f"{pipe.source}: edge {first_edge.name}: stage {sid!r} reads column "
                                 f"{f.name!r} which no upstream stage writes; edge carries "
                                 f"{sorted(have)}" + (f"; the column: {doc}" if doc else ""))
            if have[f.name] != f.type:
                raise ValueError(f"{pipe.source}: edge {first_edge.name}: column {f.name!r} is "
                                 f"{have[f.name]} but {sid!r} reads {f.type}")
