"""The Ray placement backend (molt.runtime.placement); Ray is imported only here."""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import ray
from ray.util.placement_group import placement_group, remove_placement_group
from ray.util.scheduling_strategies import (NodeAffinitySchedulingStrategy,
                                            PlacementGroupSchedulingStrategy)

from molt.runtime.placement import (FORWARDED_ENV, PlacementError, PlacementSpec, Proc,
                                    StagePlacement, free_port, signal_group)

if TYPE_CHECKING:
    from molt.runtime.pipeline import Pipeline


class Launcher:
    """A threaded Ray actor that starts one process, which dies with it, and waits for it."""

    def __init__(self) -> None:
        self.proc: Proc | None = None
        self.stopped = False

    def node(self) -> tuple[str, str]:
        """(the node's address, its Ray node id)."""
        return ray.util.get_node_ip_address(), ray.get_runtime_context().get_node_id()

    def free_port(self, host: str) -> int:
        return free_port(host)

    def start(self, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None,
              log_path: str, cwd: str, scratch: str) -> int:
        """Start ``python argv``; return its pid.

        Raises:
            FileNotFoundError: the working or the run directory is not on this node.
        """
        run_dir = str(Path(log_path).parent.parent)
        for what, folder in (("working directory", cwd), ("run directory", run_dir)):
            if not os.path.isdir(folder):
                raise FileNotFoundError(f"{name}: the {what} {folder} does not exist on node "
                                        f"{self.node()[0]}; the ray backend needs it on a "
                                        "filesystem every node mounts")
        Path(scratch).mkdir(parents=True, exist_ok=True)
        self.proc = Proc.start(name, [sys.executable, *argv], {**os.environ, **env}, cpus,
                               Path(log_path), cwd)
        if self.stopped:
            self.proc.kill()
        return self.proc.popen.pid

    def wait(self) -> int:
        assert self.proc is not None
        while (code := self.proc.poll()) is None:
            time.sleep(0.2)
        return code

    def terminate(self) -> None:
        self.stopped = True
        if self.proc is not None:
            self.proc.terminate()

    def kill(self) -> None:
        self.stopped = True
        if self.proc is not None:
            self.proc.kill()

    def stacks(self) -> str:
        return self.proc.stacks() if self.proc is not None else "no process started"


class RayProc:
    """The runner's handle of a process a launcher started (the interface of `Proc`)."""

    def __init__(self, name: str, actor: Any, ref: Any, log_path: Path, pid: int,
                 node_id: str) -> None:
        self.name, self.actor, self.ref = name, actor, ref
        self.log_path, self.pid, self.node_id = log_path, pid, node_id
        self.code: int | None = None
        self.error: str | None = None

    def poll(self) -> int | None:
        if self.code is None and ray.wait([self.ref], timeout=0)[0]:
            try:
                self.code = ray.get(self.ref)
            except ray.exceptions.RayActorError as e:
                died = str(e).splitlines()[0]
                self.code, self.error = -9, f"its Ray launcher actor died ({died})"
            except ray.exceptions.RayTaskError as e:
                self.code, self.error = 1, f"its Ray launcher failed: {e.cause!r}"
        return self.code

    def terminate(self) -> None:
        if self.poll() is None:
            self.actor.terminate.remote()

    def kill(self) -> None:
        """SIGKILL the process group (through the launcher, or a task on its node where that
        died), then the launcher."""
        orphaned = self.error is not None
        if self.poll() is None:
            try:
                ray.get(self.actor.kill.remote(), timeout=30)
            except (ray.exceptions.RayError, TimeoutError):
                orphaned = True
        ray.kill(self.actor)
        if orphaned:
            strategy = NodeAffinitySchedulingStrategy(self.node_id, soft=False)
            # a lost node takes its processes with it
            with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
                task = ray.remote(signal_group).options(num_cpus=0, scheduling_strategy=strategy)
                ray.get(task.remote(self.pid, signal.SIGKILL), timeout=30)

    def stacks(self) -> str:
        try:
            return str(ray.get(self.actor.stacks.remote(), timeout=60))
        except (ray.exceptions.RayError, TimeoutError) as e:
            return (f"no stacks: its launcher did not answer ({type(e).__name__}); see "
                    f"{self.log_path}")

    def failure(self) -> str:
        return f"{self.error or f'the process exited with code {self.code}'}; see {self.log_path}"


class RaySlot:
    """A reserved launcher, where one process will run."""

    def __init__(self, actor: Any, address: str, node_id: str) -> None:
        self.actor, self.address, self.node_id = actor, address, node_id

    def free_port(self, host: str) -> int:
        return int(ray.get(self.actor.free_port.remote(host)))

    def start(self, name: str, argv: list[str], env: dict[str, str], cpus: list[int] | None,
              log_path: Path, scratch: Path) -> RayProc:
        """Start the process through the launcher.

        Raises:
            PlacementError: the launcher could not start it.
        """
        forwarded = {k: v for k, v in os.environ.items() if k.startswith(FORWARDED_ENV)}
        try:
            pid = ray.get(self.actor.start.remote(name, argv, {**forwarded, **env}, cpus,
                                                  str(log_path.resolve()), os.getcwd(),
                                                  str(scratch)))
        except ray.exceptions.RayTaskError as e:
            raise PlacementError(name, str(e.cause)) from None
        return RayProc(name, self.actor, self.actor.wait.remote(), log_path, pid, self.node_id)


class RayBackend:
    """Connects to (or starts) a Ray cluster and reserves launchers per stage."""

    def __init__(self, spec: PlacementSpec, pipe: Pipeline) -> None:
        self.spec, self.pipe = spec, pipe
        sigterm = signal.getsignal(signal.SIGTERM)  # molt run's, which Ray's driver replaces
        if spec.address is None:
            ray.init(num_cpus=spec.num_cpus or len(os.sched_getaffinity(0)),
                     include_dashboard=False, object_store_memory=spec.object_store_mib * 2**20,
                     log_to_driver=False, logging_level=logging.WARNING)
        else:
            where = f"{pipe.source}: placement.address: {spec.address!r}"
            hint = ("hint: the address `ray start --head` printed (HOST:6379), or no "
                    "placement.address for a one-node instance")
            host, _, port = spec.address.rpartition(":")
            if port.isdigit():  # Ray retries an address where nothing answers for ever
                try:
                    socket.create_connection((host, int(port)), timeout=10).close()
                except OSError as e:
                    raise PlacementError("placement",
                                         f"{where}: nothing answers there ({e}); {hint}") from None
            try:
                ray.init(address=spec.address, log_to_driver=False, logging_level=logging.WARNING)
            except ConnectionError as e:
                first = str(e).splitlines()[0]
                raise PlacementError("placement", f"{where}: {first}; {hint}") from None
        if sigterm is not None and threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, sigterm)
        self.node_id = ray.get_runtime_context().get_node_id()  # the runner's node
        self.launcher = ray.remote(Launcher)
        self.groups: list[Any] = []
        self.nodes: set[str] = set()

    def reserve(self, sid: str, replicas: int, nodes: int) -> list[list[RaySlot]]:
        """``replicas`` lists of ``nodes`` launchers, placed and started.

        Raises:
            PlacementError: Ray cannot place them in time.
        """
        node = self.pipe.stages[sid]
        p = self.spec.stages.get(sid, StagePlacement.model_validate({}))
        cpus = p.num_cpus or 0.0  # CPU ids may be shared by stages: no count to reserve
        gpus = (p.num_gpus if p.num_gpus is not None
                else len(node.gpus) / replicas / nodes if node.gpus else 0.0)
        bundle = {k: v for k, v in {"CPU": cpus, "GPU": gpus, **p.resources}.items() if v}
        if nodes > 1 and not bundle:
            bundle = {"CPU": 0.01}  # a placement group spreads bundles by their resources
        count, timeout = replicas * nodes, self.spec.ready_timeout_s
        strategy = p.strategy or ("STRICT_SPREAD" if nodes > 1 else "PACK")
        what = (f"{self.pipe.source}: stages.{sid}: Ray could not place {count} launcher(s) of "
                f"{bundle or 'nothing'} each ({strategy})")
        hint = f"hint: ask for less in placement.stages.{sid}, or add nodes"
        if strategy == "STRICT_SPREAD":
            hint += " (STRICT_SPREAD: one node per launcher)"

        def too_slow() -> PlacementError:
            return PlacementError(sid, f"{what} within {timeout:g} s (placement.ready_timeout_s); "
                                  f"free: {_free()} of {_free(ray.cluster_resources())}; {hint}")

        if self.spec.address is None:  # the one node this run started: no other will join
            total = ray.cluster_resources()
            if (any(v * count > total.get(k, 0) for k, v in bundle.items())
                    or (strategy == "STRICT_SPREAD" and count > 1)):
                raise PlacementError(sid, f"{what} on the one-node instance this run started "
                                     f"(it has {_free(total)}); {hint} (a cluster: "
                                     "placement.address)")
        strategies: list[Any] = []
        if bundle:
            pg = placement_group([bundle] * count, strategy=strategy, name=f"molt-{sid}")
            self.groups.append(pg)
            try:
                ray.get(pg.ready(), timeout=timeout)
            except ray.exceptions.GetTimeoutError:
                raise too_slow() from None
            strategies = [PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i)
                          for i in range(count)]
        options = {"max_concurrency": 3, "num_cpus": cpus, "num_gpus": gpus,
                   "resources": p.resources or None}
        actors: list[Any] = [self.launcher.options(**options, scheduling_strategy=strategies[i]
                                                   if strategies else "DEFAULT").remote()
                             for i in range(count)]
        try:
            where = ray.get([a.node.remote() for a in actors], timeout=timeout)
        except ray.exceptions.GetTimeoutError:
            raise too_slow() from None
        slots = [RaySlot(a, address, node_id) for a, (address, node_id) in zip(actors, where)]
        self.nodes |= {s.node_id for s in slots}
        return [slots[r * nodes:(r + 1) * nodes] for r in range(replicas)]

    def remote_stage(self, slots: dict[str, list[list[RaySlot]]]) -> str | None:
        """A stage with a launcher on another node than the runner's, if any."""
        return next((sid for sid, replicas in slots.items() for r in replicas for s in r
                     if s.node_id != self.node_id), None)

    def close(self, scratch: Path) -> None:
        """Remove the placement groups and every node's scratch folder; disconnect."""
        for pg in self.groups:
            remove_placement_group(pg)
        shutil.rmtree(scratch, ignore_errors=True)
        remove = ray.remote(_remove_folder)
        # a lost node took its folder with it
        with contextlib.suppress(ray.exceptions.RayError, TimeoutError):
            others = self.nodes - {self.node_id}
            on = [NodeAffinitySchedulingStrategy(n, soft=False) for n in others]
            ray.get([remove.options(num_cpus=0, scheduling_strategy=s).remote(str(scratch))
                     for s in on], timeout=60)
        ray.shutdown()


def _free(resources: dict[str, float] | None = None) -> dict[str, float]:
    """The free (or given) resources, without memory and Ray's own keys."""
    return {k: v for k, v in (resources or ray.available_resources()).items()
            if "memory" not in k and "_group_" not in k
            and not k.startswith(("node:", "accelerator_type:"))}


def _remove_folder(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
