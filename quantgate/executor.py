"""Where independent pieces of work run: here, one after another, or as Ray tasks on a cluster (`--executor ray`).

The allocator's measured and calibrated probes (one llama.cpp quantization and one scored run each) and the
report's cells are independent given their inputs, so a cluster can run them side by side. Ray is the engine (its
scheduler, retries of a task whose worker died, its object store for the inputs every task reads); quantgate only
says what each task needs (CPUs, memory) and keeps its own content keys, so a cluster run and a local run share one
cache and resume each other. The cluster's address comes from RAY_ADDRESS (e.g. 127.0.0.1:6379, what `ray start
--head` prints); files travel by path, so every node must see the same filesystem (a laptop's cluster, a shared
mount on a real one).

Written by hand: only the thin mapping from quantgate's jobs to Ray tasks; no scheduling of its own.
"""
from __future__ import annotations

import os
import socket
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from .errors import QuantgateError
from .progress import track

EXECUTORS = ("local", "ray")
RETRIES = 3  # Ray's own retries of a task whose worker or node died


@dataclass(frozen=True)
class Needs:
    """What one task asks of the node it runs on: CPUs, bytes of memory, GPUs."""
    cpus: float = 1.0
    memory: int = 0
    gpus: float = 0.0


class LocalExecutor:
    """Every task here, in order."""
    name = "local"

    def map(self, fn: Callable, items: list, needs: Needs = Needs(), label: str | None = None,
            shared: dict | None = None) -> list:
        """[fn(item, **shared) for item in items], with a progress line when `label` names the work."""
        it: Iterable = track(items, label, total=len(items)) if label else items
        return [fn(x, **(shared or {})) for x in it]

    def nodes(self) -> list[str]:
        return [socket.gethostname()]


class RayExecutor:
    """Each task a Ray task with `needs` as its resources, retried by Ray where its worker dies; `shared` inputs put
    once into the object store and handed to every task."""
    name = "ray"

    def __init__(self, address: str):
        import ray
        self.ray, self.address = ray, address
        if not ray.is_initialized():
            ray.init(address=address, logging_level="ERROR", log_to_driver=False)

    def map(self, fn: Callable, items: list, needs: Needs = Needs(), label: str | None = None,
            shared: dict | None = None) -> list:
        ray = self.ray
        task = ray.remote(num_cpus=needs.cpus, num_gpus=needs.gpus, memory=needs.memory or None,
                          max_retries=RETRIES)(_call)
        put = {k: ray.put(v) for k, v in (shared or {}).items()}
        refs = [task.remote(fn, x, put) for x in items]

        def finished():  # one step as each task ends, in whatever order
            left = list(refs)
            while left:
                ready, left = ray.wait(left, num_returns=1)
                yield ready
        for _ in (track(finished(), label, total=len(refs)) if label else finished()):
            pass
        return ray.get(refs)

    def run_on(self, node_id: str, fn: Callable, *args, needs: Needs = Needs()):
        """fn(*args) as one task pinned to the node `node_id` (speed timings: one node, named)."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        task = self.ray.remote(num_cpus=needs.cpus, memory=needs.memory or None, max_retries=RETRIES,
                               scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False))(_call)
        return self.ray.get(task.remote(fn, args, {}, True))

    def this_node(self) -> str:
        """The node this process runs on (the driver's: where a report times its artifacts)."""
        return self.ray.get_runtime_context().get_node_id()

    def nodes(self) -> list[str]:
        return sorted(n["NodeManagerAddress"] + ":" + n["NodeID"][:8] for n in self.ray.nodes() if n["Alive"])


def _call(fn: Callable, item, shared: dict, star: bool = False):
    """A task's body: the shared inputs arrive resolved (Ray resolves top-level object refs in a dict's values only
    when they are arguments, so they are fetched here)."""
    import ray
    kw = {k: (ray.get(v) if isinstance(v, ray.ObjectRef) else v) for k, v in shared.items()}
    return fn(*item, **kw) if star else fn(item, **kw)


def open_executor(name: str | None) -> LocalExecutor | RayExecutor:
    """The executor `--executor` names: local (default) or ray, whose address is RAY_ADDRESS. Without ray installed,
    without the variable, or with an address nothing answers at: one line, before any work."""
    if name in (None, "local"):
        return LocalExecutor()
    if name != "ray":
        raise QuantgateError(f"--executor must be one of {', '.join(EXECUTORS)}, got {name!r}")
    try:
        import ray  # noqa: F401
    except ImportError:
        raise QuantgateError("--executor ray needs Ray: pip install 'quantgate[ray]'") from None
    address = os.environ.get("RAY_ADDRESS", "").strip()
    if not address:
        raise QuantgateError("--executor ray needs RAY_ADDRESS, a running cluster's address (ray start --head prints "
                             "it, e.g. 127.0.0.1:6379)")
    host, _, port = address.removeprefix("ray://").rpartition(":")
    try:
        with socket.create_connection((host or "127.0.0.1", int(port)), timeout=5):
            pass
    except (OSError, ValueError):
        raise QuantgateError(f"--executor ray: no Ray cluster answers at RAY_ADDRESS={address}") from None
    try:
        return RayExecutor(address)
    except Exception as e:  # ray's own connection errors are of many kinds
        raise QuantgateError(f"--executor ray: cannot join the cluster at {address}: {str(e).splitlines()[0][:200]}") \
            from None
