"""Data-parallel actors on a Ray cluster (`--ray-address` of collect, eval and reward): connect, place, get, close.

- The connection: `RayCluster(address)` connects to the cluster at `address` ("auto": the one this
  machine belongs to). A process already connected (e.g. by its own `ray.init()`) keeps its
  connection: it is used and left open; a connection opened here is closed by `close()`.
- The placement: `start(build, size, gpus_per_actor)` starts `size` actors, each asking for
  `gpus_per_actor` GPUs where the cluster has GPUs (Ray then sets the actor's CUDA_VISIBLE_DEVICES),
  else for cores / size CPUs, with OMP_NUM_THREADS and torch's thread count set to that many so the
  actors on one node do not oversubscribe it. Actor `rank` holds `build(rank)` (built in the actor's
  process: `build` travels pickled, so a module-level function or a functools.partial of one), and
  `actor.call.remote(method, *args)` runs `build(rank).method(*args)` there.
- The results: `get(refs)` returns them; an actor's UserError comes back as that UserError, any
  other failure or a dead actor as `failure` (an exception class) with one line naming `what` failed.
"""

from __future__ import annotations

import os
from collections.abc import Callable

from offline_rec.errors import UserError, missing_extra


class RayCluster:
    """A connection to a Ray cluster and the actors started through it; use as a context manager."""

    def __init__(self, address: str, what: str = "actor", failure: type[Exception] = RuntimeError):
        try:
            import ray
        except ImportError:
            raise missing_extra("--ray-address", "ray", "ray") from None
        self.ray = ray
        self.what, self.failure = what, failure
        self.actors: list = []
        self._connected_here = not ray.is_initialized()
        if self._connected_here:
            try:
                ray.init(address=address, log_to_driver=False)
            except (ConnectionError, ValueError, RuntimeError) as error:
                reason = str(error).splitlines()[0]
                raise UserError(f"--ray-address {address}: cannot connect to Ray ({reason})") from None

    def start(self, build: Callable[[int], object], size: int, gpus_per_actor: int = 1) -> list:
        """`size` actors, actor k holding build(k) (see the module docstring for what each asks for)."""
        resources = self.ray.cluster_resources()
        if int(resources.get("GPU", 0)):
            options, environment = {"num_gpus": gpus_per_actor, "num_cpus": 1}, {}
        else:
            threads = max(1, int(resources.get("CPU", 1)) // size)
            options, environment = {"num_cpus": threads}, {"OMP_NUM_THREADS": str(threads)}
        actor_class = self.ray.remote(**options)(_ActorHost)
        started = [actor_class.remote(build, rank, environment) for rank in range(size)]
        self.actors.extend(started)
        return started

    def wait(self, refs: list) -> list:
        """The refs among `refs` that are ready (at least one; blocks until then)."""
        ready, _ = self.ray.wait(list(refs), num_returns=1)
        return ready

    def get(self, refs):
        try:
            return self.ray.get(refs)
        except self.ray.exceptions.RayTaskError as error:
            cause = error.cause if hasattr(error, "cause") else None
            if isinstance(cause, UserError):
                raise UserError(str(cause)) from None
            raise self.failure(f"a Ray {self.what} failed: {str(error).strip().splitlines()[-1]}") from None
        except self.ray.exceptions.RayActorError as error:
            raise self.failure(f"a Ray {self.what} died: {str(error).strip().splitlines()[0]}") from None

    def close(self) -> None:
        """Kill the actors started here; disconnect if the connection was opened here."""
        for actor in self.actors:
            try:
                self.ray.kill(actor)
            except Exception:  # already gone
                pass
        self.actors = []
        if self._connected_here and self.ray.is_initialized():
            self.ray.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _ActorHost:
    """The Ray actor around one `build(rank)` object (its methods run one at a time, in the actor's process)."""

    def __init__(self, build: Callable[[int], object], rank: int, environment: dict[str, str]):
        enter_worker_environment(environment)
        self.target = build(rank)

    def call(self, method: str, *args):
        return getattr(self.target, method)(*args)


def enter_worker_environment(environment: dict[str, str]) -> None:
    """In a worker process (a Ray actor, or collect's local engine processes): set `environment`, and torch's
    threads to its OMP_NUM_THREADS, which torch reads at import only (that may have happened already)."""
    os.environ.update(environment)
    threads = environment.get("OMP_NUM_THREADS")
    if threads:
        import torch

        torch.set_num_threads(int(threads))
