"""Sampling engines for `collect`: one engine's loop; N engines in this process, child processes or Ray actors.

One engine (`EngineWorker`): prompts go to the backend's stream (backends/__init__.py) as long as
fewer than its window are in flight, so a vLLM engine always has requests waiting; after every
engine step the prompts that finished are handed to a thread pool that scores their rewards
(each call limited to the reward timeout) while the engine samples on. Prompts come in UNITS
(collect: one prompt for vLLM, one batch for transformers, whose seed covers the batch); a unit
is returned once all its prompts are scored, so a caller that writes whole units commits shards
at unit boundaries.

N engines (`run_on_engines`): a coordinator (the calling process) hands units to the engine that
has the fewest waiting and gets their results back; only the coordinator writes, so the N engines
fill ONE dataset with one manifest, each prompt exactly once. The engines live in
- `LocalEngines`: this process (one engine, the `collect` default);
- `WorkerEngines`: N workers of offline_rec/workers.py, the fan-out reward scoring shares: child processes
  (spawned; on a GPU machine each sees its own --tensor-parallel-size GPUs through CUDA_VISIBLE_DEVICES; on a
  CPU each gets cores / N threads; a child dies with the coordinator), or Ray actors on a running Ray cluster
  (`--ray-address`), one GPU set or a few CPUs each. Results travel back to the coordinator, which writes the
  dataset where it runs; an engine that dies ends the run with an error after the finished groups are written.
An engine's sampler is seeded with derive_seed(run seed, engine index) (see backends/vllm.py for
what that makes reproducible).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field, replace
from functools import partial

from offline_rec.devices import visible_gpus
from offline_rec.errors import UserError
from offline_rec.rollout.backends import Sample, SamplingSettings, derive_seed
from offline_rec.rollout.config import DEFAULT_REWARD_WORKERS

WORK_BUDGET_S = 0.5
"""How long one `work` call may run before it returns its finished units (and takes new ones)."""
ENGINE_CLOSE_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class PromptRequest:
    """One prompt to sample K completions for and reward."""

    index: int
    """The prompt's index in the run's plan (the caller's key)."""
    unit: int
    """Prompts of one unit are sampled in one stream step where the backend batches (hf) and returned together."""
    prompt: str
    """The rendered prompt text (what the reward sees)."""
    prompt_ids: list[int]
    fields: dict
    seed: int


@dataclass
class PromptResult:
    index: int
    samples: list[Sample]
    rewards: list[float | None]
    reward_stats: dict


@dataclass(frozen=True)
class Job:
    """What every engine of a run samples and how it scores it."""

    task: str
    reward: str | None
    num_samples: int
    sampling: SamplingSettings
    seed: int
    """The run's seed; engine w seeds its sampler with derive_seed(seed, w)."""
    per_request_seeds: bool = False
    window: int | None = None
    """Prompts in flight per engine (None: the backend's default_window)."""
    reward_timeout_s: float | None = None
    reward_workers: int = DEFAULT_REWARD_WORKERS

    def for_engine(self, rank: int) -> Job:
        return replace(self, seed=derive_seed(self.seed, rank))


@dataclass(frozen=True)
class EngineSpec:
    """How an engine is built in another process (`make_backend`'s arguments)."""

    backend: str
    model: str
    dtype: str | None = None
    tensor_parallel_size: int = 1
    seed: int = 0
    per_request_seeds: bool = False
    engine_kwargs: dict = field(default_factory=dict)

    def build(self, rank: int):
        from offline_rec.rollout.backends import make_backend

        return make_backend(self.backend, self.model, dtype=self.dtype, tensor_parallel_size=self.tensor_parallel_size,
                            seed=derive_seed(self.seed, rank), per_request_seeds=self.per_request_seeds,
                            **self.engine_kwargs)


# --------------------------------------------------------------------------------------------
# one engine


class EngineWorker:
    """One engine's loop for a job (see the module docstring). `begin`, then `work` until `has_work` is false, `end`."""

    def __init__(self, backend):
        self.backend = backend
        self._stream = None

    @property
    def info(self) -> dict:
        """What the manifest records about the engine."""
        return {"engine": self.backend.engine, "engine_version": self.backend.engine_version,
                "dtype": self.backend.dtype,
                "per_request_seeds": getattr(self.backend, "per_request_seeds_supported", True)}

    def begin(self, job: Job, rank: int = 0, source: Iterable[list[PromptRequest]] | None = None) -> int:
        """Start `job` as engine `rank`; units come from `source` (lazily) and from `work`. Returns the window."""
        from offline_rec.tasks.builtin import get_task

        if self._stream is not None:
            raise RuntimeError("a job is already running on this engine")
        job = job.for_engine(rank)
        self._task = get_task(job.task, job.reward)
        self._job = job
        self.window = job.window or self.backend.default_window(job.num_samples)
        self._source = iter(source) if source is not None else None
        self._queue: deque[list[PromptRequest]] = deque()
        self._requests: dict[int, PromptRequest] = {}  # in the engine or being scored
        self._in_engine = 0
        self._unit_size: dict[int, int] = {}
        self._unsampled: dict[int, int] = {}  # per unit: prompts the engine has not returned yet
        self._sampled: deque[int] = deque()  # units in the order the engine finished them
        self._scored: dict[int, list[PromptResult]] = {}
        self._scoring: dict[Future, tuple[int, list[Sample]]] = {}
        self._finished: list[list[PromptResult]] = []
        self._pool = ThreadPoolExecutor(max(1, job.reward_workers), thread_name_prefix="reward")
        stream = self.backend.stream(job.num_samples, job.sampling, seed=job.seed,
                                     per_request_seeds=job.per_request_seeds)
        stream.__enter__()
        self._stream = stream
        return self.window

    @property
    def backlog(self) -> int:
        """Prompts given to this engine that it has not sampled yet (queued or in flight)."""
        return sum(len(unit) for unit in self._queue) + self._stream.pending

    @property
    def has_work(self) -> bool:
        return bool(self._queue or self._source is not None or self._requests or self._sampled or self._finished)

    def work(self, units: Iterable[list[PromptRequest]] = (), budget_s: float = WORK_BUDGET_S,
             ) -> list[list[PromptResult]]:
        """Take `units`, sample and score for up to `budget_s` (at least one engine step), return the finished units."""
        self._queue.extend(units)
        deadline = time.monotonic() + budget_s
        while True:
            self._fill()
            if self._stream.pending:
                for index, samples in self._stream.step().items():
                    self._score(index, samples)
            self._collect(block_until=None)
            idle_engine = not self._stream.pending and not self._queue and self._source is None
            if time.monotonic() >= deadline or (idle_engine and not self._scoring):
                break
            if idle_engine:  # only rewards left: wait for them rather than spin
                self._collect(block_until=deadline)
        finished, self._finished = self._finished, []
        return finished

    def end(self) -> None:
        """Finish the job: abort what is in flight, abandon rewards still running (their threads end on their own)."""
        stream, self._stream = self._stream, None
        if stream is not None:
            try:
                stream.__exit__(None, None, None)
            finally:
                self._pool.shutdown(wait=False, cancel_futures=True)

    def _fill(self) -> None:
        while self._stream.pending < self.window:
            unit = self._next_unit()
            if unit is None:
                return
            self._unit_size[unit[0].unit] = self._unsampled[unit[0].unit] = len(unit)
            for request in unit:
                self._requests[request.index] = request
                self._stream.add(request.index, request.prompt_ids, seed=request.seed)

    def _next_unit(self) -> list[PromptRequest] | None:
        if self._queue:
            return self._queue.popleft()
        if self._source is not None:
            unit = next(self._source, None)
            if unit is not None:
                return unit
            self._source = None
        return None

    def _score(self, index: int, samples: list[Sample]) -> None:
        from offline_rec.tasks.builtin import score_many

        request = self._requests[index]
        self._unsampled[request.unit] -= 1
        if not self._unsampled[request.unit]:
            del self._unsampled[request.unit]
            self._sampled.append(request.unit)
        k = len(samples)
        future = self._pool.submit(score_many, self._task, [request.prompt] * k, [s.text for s in samples],
                                   [request.fields] * k, timeout_s=self._job.reward_timeout_s)
        self._scoring[future] = (index, samples)

    def _collect(self, block_until: float | None) -> None:
        """Move scored prompts into their units. Units are finished in the order the engine finished them (so
        one engine's output order does not depend on how fast rewards are scored): the oldest, once scored."""
        if not self._scoring:
            return
        if block_until is None:
            done = [f for f in self._scoring if f.done()]
        else:
            done, _ = wait(list(self._scoring), timeout=max(0.0, block_until - time.monotonic()),
                           return_when=FIRST_COMPLETED)
        for future in done:
            index, samples = self._scoring.pop(future)
            request = self._requests.pop(index)
            rewards, stats = future.result()
            self._scored.setdefault(request.unit, []).append(PromptResult(index, samples, rewards, stats))
        while self._sampled and len(self._scored.get(self._sampled[0], ())) == self._unit_size[self._sampled[0]]:
            unit = self._sampled.popleft()
            del self._unit_size[unit]
            self._finished.append(sorted(self._scored.pop(unit), key=lambda r: r.index))


# --------------------------------------------------------------------------------------------
# N engines


class EngineError(RuntimeError):
    """An engine failed or died; the units it held were not finished."""


def run_on_engines(engines, job: Job, units: Iterable[list[PromptRequest]], unit_size: int,
                   on_units: Callable[[list[list[PromptResult]]], None]) -> None:
    """Sample every unit of `units` once on `engines`, calling `on_units` with finished units as they come."""
    if isinstance(engines, LocalEngines):
        worker = engines.worker
        worker.begin(job, rank=0, source=units)
        try:
            while worker.has_work:
                finished = worker.work()
                if finished:
                    on_units(finished)
        finally:
            worker.end()
        return
    windows = engines.begin(job)
    try:
        _coordinate(engines, windows, iter(units), unit_size, on_units)
    finally:
        engines.end()


def _coordinate(engines, windows: list[int], units: Iterator[list[PromptRequest]], unit_size: int,
                on_units) -> None:
    """Keep each engine's backlog at about two windows (one in flight, one waiting), refilling it as results return."""
    n = len(windows)
    target = [2 * max(window, unit_size) for window in windows]
    backlog, busy, has_work = [0] * n, [False] * n, [False] * n
    exhausted = False
    while True:
        # Idle engines take units in turn, not one engine up to its target first: a run with fewer
        # prompts than the engines' targets (or its tail) is still spread over all of them.
        new: dict[int, list] = {w: [] for w in range(n) if not busy[w]}
        hungry = [w for w in new if backlog[w] < target[w]]
        while hungry and not exhausted:
            for w in hungry:
                unit = next(units, None)
                if unit is None:
                    exhausted = True
                    break
                new[w].append(unit)
                backlog[w] += len(unit)
            hungry = [w for w in hungry if backlog[w] < target[w]]
        for w, fresh in new.items():
            if fresh or has_work[w]:
                engines.submit(w, fresh)
                busy[w] = True
        if not any(busy):
            return
        for w, finished, engine_backlog, engine_has_work in engines.wait():
            busy[w] = False
            backlog[w], has_work[w] = engine_backlog, engine_has_work
            if finished:
                on_units(finished)


class LocalEngines:
    """One engine in this process (an already built backend)."""

    size = 1

    def __init__(self, backend):
        self.worker = EngineWorker(backend)
        self.info = self.worker.info

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def check_gpus(size: int, tensor_parallel_size: int, gpus: list[str]) -> None:
    if gpus and len(gpus) < size * tensor_parallel_size:
        raise UserError(
            f"--data-parallel-size {size} x --tensor-parallel-size {tensor_parallel_size} needs "
            f"{size * tensor_parallel_size} GPUs; {len(gpus)} are visible"
        )


class WorkerEngines:
    """N engines in worker processes (offline_rec/workers.py): spawned children, or Ray actors on the cluster at
    `address` ("auto": the running one); use as a context manager.

    A child sees its own --tensor-parallel-size GPUs (or, on a CPU, cores / N threads); an actor asks for
    --tensor-parallel-size GPUs where the cluster has GPUs, else for cores / N CPUs. If this process is already
    connected to Ray (e.g. a local `ray.init()`), that connection is used and left open.
    """

    def __init__(self, spec: EngineSpec, size: int, address: str | None = None):
        from offline_rec.workers import start_workers

        if not address:
            check_gpus(size, spec.tensor_parallel_size, visible_gpus())
        self.size = size
        self.workers = start_workers(partial(_HostedEngine, spec), size, what="engine", failure=EngineError,
                                     address=address, gpus_per_worker=spec.tensor_parallel_size)
        self._pending = {}
        try:
            self.info = self.workers.call_all("info")[0]
        except BaseException:
            self.close()
            raise

    def begin(self, job: Job) -> list[int]:
        return self.workers.call_all("begin", job)

    def submit(self, rank: int, units: list[list[PromptRequest]]) -> None:
        self._pending[self.workers.submit(rank, "work", units)] = rank

    def wait(self) -> list[tuple[int, list, int, bool]]:
        results = []
        for handle in self.workers.wait(list(self._pending)):
            rank = self._pending.pop(handle)
            results.append((rank, *self.workers.get(handle)))
        return results

    def end(self) -> None:
        try:
            self.workers.call_all("end")
        except (EngineError, OSError):
            pass

    def close(self) -> None:
        self.workers.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class _HostedEngine:
    """One worker's `EngineWorker` (held in the worker's process: a child or a Ray actor)."""

    def __init__(self, spec: EngineSpec, rank: int):
        self.rank = rank
        self.worker = EngineWorker(spec.build(rank))

    def info(self) -> dict:
        return self.worker.info

    def begin(self, job: Job) -> int:
        return self.worker.begin(job, rank=self.rank)

    def work(self, units):
        finished = self.worker.work(units)
        return finished, self.worker.backlog, self.worker.has_work

    def end(self) -> None:
        self.worker.end()

    def close(self) -> None:
        self.worker.end()
