"""N objects that live in worker processes, called from this one: local child processes or Ray actors, one interface.

Collect's engines (rollout/engines.py) and reward-model scoring (rewards/reward_model.py) fan out through it.
`start_workers(build, size, ...)` starts `size` workers; worker `rank` holds `build(rank)`, built in its own
process (`build` travels pickled: a module-level class or function, or a functools.partial of one). Then
- `submit(rank, method, *args)` calls `build(rank).method(*args)` there and returns a handle at once;
  a worker runs its calls one at a time, in the order they were submitted;
- `wait(handles)` blocks until at least one of them is answered and returns those answered;
- `get(handle)` its result (`call_all(method, *args)`: the same call on every worker, the results in rank order);
- `close()` (or the `with` block's end) stops every worker.
A worker's UserError comes back as that UserError; any other failure, or a worker that dies, raises `failure`
(an exception class) with one line naming `what` failed.

Where the workers run:
- Local (no address): spawned child processes, worker k with `environments[k]` entered before `build` runs
  (`worker_environments`: its GPUs, or on a CPU its share of the cores). A child dies with this process
  (PR_SET_PDEATHSIG on Linux, and EOF on its pipe elsewhere), and `close` asks, then terminates, then kills.
- Ray (`address`, "auto": the running cluster): actors placed by ray_cluster.py, `gpus_per_worker` GPUs each
  where the cluster has GPUs (Ray sets their CUDA_VISIBLE_DEVICES), else a share of its CPUs.
"""

from __future__ import annotations

import os
import sys
import time
from collections import deque
from collections.abc import Callable

from offline_rec.devices import visible_gpus
from offline_rec.errors import UserError
from offline_rec.ray_cluster import RayCluster, enter_worker_environment

CLOSE_TIMEOUT_S = 30.0
"""How long `close` waits for the local workers to end on their own before it terminates them."""


def worker_environments(size: int, gpus_per_worker: int = 1, share_gpus: bool = False) -> list[dict[str, str]]:
    """The environment of each of `size` local workers: on a GPU machine its `gpus_per_worker` GPUs
    (`devices.visible_gpus`: worker k the k-th block; `share_gpus`: round robin, so that more workers than GPUs
    share them), else its share of the cores as OMP_NUM_THREADS (this process's OMP_NUM_THREADS where it is
    set)."""
    gpus = visible_gpus()
    if gpus and share_gpus:
        return [{"CUDA_VISIBLE_DEVICES": gpus[rank % len(gpus)]} for rank in range(size)]
    if gpus:
        return [{"CUDA_VISIBLE_DEVICES": ",".join(gpus[rank * gpus_per_worker:(rank + 1) * gpus_per_worker])}
                for rank in range(size)]
    threads = os.environ.get("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // size)))
    return [{"OMP_NUM_THREADS": threads} for _ in range(size)]


def start_workers(build: Callable[[int], object], size: int, *, what: str, failure: type[Exception],
                  address: str | None = None, gpus_per_worker: int = 1,
                  environments: list[dict[str, str]] | None = None) -> ProcessWorkers | RayWorkers:
    """`size` workers holding build(0..size-1): Ray actors on the cluster at `address`, else local child processes
    with `environments` (default: `worker_environments(size, gpus_per_worker)`). See the module docstring."""
    if address:
        return RayWorkers(build, size, address, gpus_per_worker=gpus_per_worker, what=what, failure=failure)
    return ProcessWorkers(build, size, environments or worker_environments(size, gpus_per_worker), what=what,
                          failure=failure)


class _Workers:
    """What both kinds share: the calls built on submit / wait / get, and the context manager."""

    size: int

    def call_all(self, method: str, *args) -> list:
        handles = [self.submit(rank, method, *args) for rank in range(self.size)]
        return [self.get(handle) for handle in handles]

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _Call:
    """A call submitted to a local worker: answered once its reply has been read."""

    def __init__(self, rank: int):
        self.rank = rank
        self.answered = False
        self.value = None


class ProcessWorkers(_Workers):
    """Workers in spawned child processes, each serving its calls over a pipe (`_serve`)."""

    def __init__(self, build: Callable[[int], object], size: int, environments: list[dict[str, str]], *, what: str,
                 failure: type[Exception]):
        import multiprocessing

        context = multiprocessing.get_context("spawn")
        self.size, self.what, self.failure = size, what, failure
        self.processes, self.connections = [], []
        self._calls: list[deque[_Call]] = [deque() for _ in range(size)]  # each worker's unanswered calls, in order
        try:
            for rank in range(size):
                parent, child = context.Pipe()
                process = context.Process(target=_serve, args=(child, build, rank, environments[rank]),
                                          name=f"offline-rec-{what.replace(' ', '-')}-{rank}", daemon=True)
                process.start()
                child.close()
                self.processes.append(process)
                self.connections.append(parent)
            for rank in range(size):
                self._receive(rank)  # built: a failing build is raised here
        except BaseException:
            self.close()
            raise

    def submit(self, rank: int, method: str, *args) -> _Call:
        call = _Call(rank)
        try:
            self.connections[rank].send((method, args))
        except OSError:  # the worker is gone: say how
            self._receive(rank)
        self._calls[rank].append(call)
        return call

    def wait(self, calls: list[_Call]) -> list[_Call]:
        from multiprocessing.connection import wait as wait_any

        while True:
            answered = [call for call in calls if call.answered]
            if answered:
                return answered
            ranks = sorted({call.rank for call in calls})
            ready = wait_any([self.connections[r] for r in ranks] + [self.processes[r].sentinel for r in ranks])
            for rank in ranks:
                if self.connections[rank] in ready or self.processes[rank].sentinel in ready:
                    call = self._calls[rank].popleft()
                    call.value, call.answered = self._receive(rank), True

    def get(self, call: _Call):
        if not call.answered:
            self.wait([call])
        return call.value

    def _receive(self, rank: int):
        """The next reply of worker `rank`: its value, or its failure raised here."""
        connection, process = self.connections[rank], self.processes[rank]
        try:
            kind, payload = connection.recv()
        except (EOFError, OSError):
            process.join(5)
            raise self.failure(f"{self.what} {rank} (pid {process.pid}) died{_exit_description(process.exitcode)}"
                               ) from None
        if kind == "error":
            user_error, text = payload
            raise UserError(text) if user_error else self.failure(f"{self.what} {rank} failed: {text}")
        return payload

    def close(self) -> None:
        """Stop every worker: ask, then terminate, then kill; none is left behind."""
        for connection in self.connections:
            try:
                connection.send(None)
            except OSError:
                pass
        deadline = time.monotonic() + CLOSE_TIMEOUT_S
        for process in self.processes:
            process.join(max(0.0, deadline - time.monotonic()))
            if process.is_alive():
                process.terminate()
                process.join(5)
            if process.is_alive():
                process.kill()
                process.join()
        for connection in self.connections:
            connection.close()
        self.processes, self.connections = [], []


def _serve(connection, build: Callable[[int], object], rank: int, environment: dict[str, str]) -> None:
    """A local worker's life: enter its environment, build its object, answer calls until told to stop (None) or
    until the coordinator is gone; then the object's `close()`, if it has one."""
    _die_with_parent()
    target = None
    try:
        enter_worker_environment(environment)
        target = build(rank)
        connection.send(("ok", None))
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                return  # the coordinator is gone
            if message is None:
                return
            method, args = message
            connection.send(("ok", getattr(target, method)(*args)))
    except BaseException as error:  # reported to the coordinator, which raises it
        try:
            connection.send(("error", (isinstance(error, UserError), _describe(error))))
        except OSError:
            pass
        if not isinstance(error, (UserError, KeyboardInterrupt)):
            import traceback

            traceback.print_exc()
    finally:
        if target is not None and hasattr(target, "close"):
            try:
                target.close()
            except Exception:  # the process is ending anyway
                pass


def _describe(error: BaseException) -> str:
    text = str(error).strip()
    return text if isinstance(error, UserError) else f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def _exit_description(code: int | None) -> str:
    if code is None:
        return ""
    if code < 0:
        import signal

        return f" (killed by {signal.Signals(-code).name})"
    return f" (exit code {code})"


def _die_with_parent() -> None:
    """Linux: the kernel kills this process when its parent dies (a kill -9 of the coordinator included)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGKILL)
    except OSError:
        pass
    if os.getppid() == 1:  # the parent died before the call above
        os._exit(1)


class RayWorkers(_Workers):
    """Workers as Ray actors (ray_cluster.py); a Ray connection this process had before is left open."""

    def __init__(self, build: Callable[[int], object], size: int, address: str, *, gpus_per_worker: int, what: str,
                 failure: type[Exception]):
        self.size = size
        self.cluster = RayCluster(address, what=what, failure=failure)
        try:
            self.actors = self.cluster.start(build, size, gpus_per_worker)
        except BaseException:
            self.close()
            raise

    def submit(self, rank: int, method: str, *args):
        return self.actors[rank].call.remote(method, *args)

    def wait(self, refs: list) -> list:
        return self.cluster.wait(refs)

    def get(self, ref):
        return self.cluster.get(ref)

    def close(self) -> None:
        self.cluster.close()
