"""`offline-rec collect`: sample K completions per prompt with a behavior policy, reward them, log them.

Pipeline: the task's prompts (a file, or a built-in source such as arith) -> this run's slice of them
(prompt index mod --num-shards) -> batches of --batch-size prompts -> a sampling backend (vLLM or
transformers, see `offline_rec.rollout.backends`) -> the task's reward -> one group per prompt instance, in
a `DatasetWriter` that commits a shard every --groups-per-shard groups.

Reproducibility and resume:
- prompt i is sampled with seed derive_seed(seed, i): vLLM seeds each request with it; transformers
  seeds each batch from the seeds of its prompts, so with a fixed batch size batch b always gets the
  same seed. Either way a prompt's samples do not depend on which run, slice or retry produced them
  (up to the engine's batch-dependent numerics).
- shards are committed only at batch boundaries, with {"batches_done": b} in the manifest, so that
  after a crash or kill -9 `--resume` skips the committed batches and redoes the rest: no group is
  lost or duplicated, and the resumed dataset holds the same groups as an uninterrupted run.
- the options that shape the data are stored in the manifest (source.options); resuming with
  different ones is refused.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from offline_rec import schema as S
from offline_rec.data.dataset import DatasetWriter, make_row, read_manifest
from offline_rec.errors import DataError, UserError, one_of
from offline_rec.models.loading import load_tokenizer, tokenizer_hash
from offline_rec.progress import ProgressBar
from offline_rec.rollout.backends import (
    Backend,
    SamplingSettings,
    check_backend_name,
    derive_seed,
    make_backend,
    resolved_dtype,
)
from offline_rec.tasks.builtin import (
    REWARD_TIMEOUT_S,
    SPLITS,
    Task,
    get_prompts,
    get_task,
    merge_reward_stats,
    score_many,
)
from offline_rec.tasks.prompts import PromptItem, render_prompt

DEFAULT_BUILTIN_PROMPTS = 512
# Collect commits shards itself, at batch boundaries (see the module docstring): the writer's own
# every-N-groups commit, which could fall inside a batch, is kept out of the way.
_NEVER = 1 << 62

# CollectConfig fields that shape the data; a resume must agree with the dataset on all of them.
IDENTITY_FIELDS = (
    "model", "task", "reward", "prompts", "prompt_column", "num_prompts", "split", "chat_template",
    "num_samples", "temperature", "top_p", "top_k", "max_new_tokens", "seed", "batch_size",
    "num_shards", "shard_index", "policy_version", "behavior",
)


@dataclass
class CollectConfig:
    """Every option of `offline-rec collect`."""

    model: str
    """Behavior policy: a model folder or hub id."""
    task: str
    """Task name (arith, gsm8k, math) or module:function (a reward over a --prompts file)."""
    out: Path
    """New dataset directory (or the one to continue with resume)."""
    num_samples: int = 8
    """K: completions per prompt (one group)."""
    prompts: str | None = None
    """Prompt file (JSONL or Parquet); default: the task's built-in prompts."""
    prompt_column: str | None = None
    """The prompt file's prompt column (default: the task's, usually "prompt")."""
    num_prompts: int | None = None
    """Use the first N prompts of the file, or N built-in prompts (default: all / 512)."""
    split: str = "train"
    """Built-in prompts: train or test split."""
    reward: str | None = None
    """module:function replacing the task's reward."""
    backend: str | None = None
    """hf or vllm (default: vllm when importable, else hf)."""
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None
    """None or 0: no top-k truncation."""
    max_new_tokens: int = 256
    seed: int = 0
    """Seeds the sampling (per prompt) and picks the built-in prompts."""
    batch_size: int = 16
    """Prompts per generate call (each with num_samples samples)."""
    dtype: str | None = None
    """float32, bfloat16, float16; default: the checkpoint's saved dtype."""
    chat_template: bool = True
    """Render chat-message prompts with the tokenizer's chat template (else as plain 'role: content' lines)."""
    tensor_parallel_size: int = 1
    groups_per_shard: int = 256
    """Commit a shard once this many groups are buffered (at the next batch boundary)."""
    resume: bool = False
    """Continue an interrupted collect into `out`."""
    num_shards: int = 1
    """Collect only prompts whose index mod num_shards == shard_index (scale-out over machines)."""
    shard_index: int = 0
    policy_version: int | None = None
    """Training updates of the behavior policy (0 = base); None: read from the model folder
    (a checkpoint's trainer_state.json or a RUN/final's summary.json), else 0."""
    behavior: str | None = None
    """Name stored in each row's `behavior` column (default: the model)."""
    reward_timeout_s: float | None = REWARD_TIMEOUT_S
    """Seconds per reward call; a call past it scores null (None or 0: no limit)."""
    show_progress: bool = True

    def __post_init__(self):
        self.out = Path(self.out)
        if self.top_k == 0:
            self.top_k = None
        _ = self.sampling  # validates temperature, top-p, top-k, max-new-tokens
        positive = {
            "num-samples": self.num_samples,
            "batch-size": self.batch_size,
            "groups-per-shard": self.groups_per_shard,
            "num-shards": self.num_shards,
            "tensor-parallel-size": self.tensor_parallel_size,
        }
        for name, value in positive.items():
            if value < 1:
                raise UserError(f"--{name} must be >= 1, got {value}")
        if not 0 <= self.shard_index < self.num_shards:
            raise UserError(
                f"--shard-index must be in 0..{self.num_shards - 1} (--num-shards {self.num_shards}), got {self.shard_index}"
            )
        if self.num_prompts is not None and self.num_prompts < 1:
            raise UserError(f"--num-prompts must be >= 1, got {self.num_prompts}")
        if self.split not in SPLITS:
            raise one_of("split", self.split, SPLITS)
        if self.policy_version is None:
            from offline_rec.models.versions import model_policy_version

            self.policy_version = model_policy_version(self.model)
        if self.policy_version < 0:
            raise UserError(f"--policy-version must be >= 0, got {self.policy_version}")

    @property
    def sampling(self) -> SamplingSettings:
        return SamplingSettings(temperature=self.temperature, top_p=self.top_p, top_k=self.top_k,
                                max_new_tokens=self.max_new_tokens)

    @property
    def behavior_name(self) -> str:
        return self.behavior or self.model


@dataclass
class _Plan:
    """What a run will sample: the slice's prompts in batches, with their rendered text and tokens."""

    task: Task
    items: list[PromptItem]
    indices: list[int]
    """Indices (into items) of this slice's prompts, in order."""
    texts: dict[int, str]
    prompt_ids: dict[int, list[int]]
    group_ids: dict[int, str]
    batches: list[list[int]]


def collect(config: CollectConfig, backend: Backend | None = None) -> Path:
    """Sample, reward and write the dataset `config.out`; returns its path.

    `backend` reuses a loaded backend (its model must be `config.model`); by default one is built
    from the config. Everything a user can get wrong is checked before any file is written.
    """
    task = get_task(config.task, config.reward)
    tokenizer = backend.tokenizer if backend is not None else load_tokenizer(config.model)
    backend_name = _backend_name(backend) if backend is not None else check_backend_name(config.backend)
    dtype = backend.dtype if backend is not None else resolved_dtype(config.dtype, config.model)
    identity = {
        **{name: _plain(getattr(config, name)) for name in IDENTITY_FIELDS},
        "dtype": dtype,
        "backend": backend_name,
    }

    existing = _existing_manifest(config.out)
    committed = bool(existing and existing[S.M_SHARDS])
    if existing is not None and not config.resume:
        raise UserError(f"output {config.out} already exists; choose another --out, or pass --resume to continue it")
    if committed:
        _check_same_options(config.out, existing, identity)
        if existing.get(S.M_COMPLETE):
            return config.out

    plan = _plan(config, task, tokenizer)
    if backend is None:
        backend = make_backend(
            backend_name, config.model, dtype=dtype, tensor_parallel_size=config.tensor_parallel_size, seed=config.seed
        )
    behavior = S.behavior_provenance(
        model=config.model, tokenizer_hash=tokenizer_hash(tokenizer), dtype=backend.dtype, engine=backend.engine,
        engine_version=backend.engine_version, temperature=config.temperature, top_p=config.top_p,
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
        "chat_template": config.chat_template,
        "reward_timeout_s": config.reward_timeout_s,
        "slice": {"num_shards": config.num_shards, "shard_index": config.shard_index, "prompts": len(plan.indices)},
    }
    source = {"command": "collect", "options": identity}
    writer = DatasetWriter(config.out, behavior=behavior, task=task_block, source=source, groups_per_shard=_NEVER,
                           resume=committed, overwrite=existing is not None and not committed)
    _sample_into(writer, config, plan, backend)
    return writer.close()


def _sample_into(writer: DatasetWriter, config: CollectConfig, plan: _Plan, backend: Backend) -> None:
    """Sample every batch not yet committed, committing at batch boundaries."""
    batches_done = int(writer.progress.get("batches_done", 0))
    _check_progress(writer, plan, batches_done)
    progress = {"batches_done": batches_done, "batch_size": config.batch_size, "batches": len(plan.batches)}
    pending_groups = 0
    started, samples, tokens = time.monotonic(), 0, 0
    with ProgressBar("collect", len(plan.indices), unit="prompts", enabled=config.show_progress) as bar:
        bar.advance(sum(len(b) for b in plan.batches[:batches_done]))
        try:
            for b in range(batches_done, len(plan.batches)):
                groups, batch_stats = _sample_batch(config, plan, plan.batches[b], backend)
                writer.add_groups(groups)
                _add_stats(writer.stats, batch_stats)
                pending_groups += len(groups)
                progress = {**progress, "batches_done": b + 1}
                rows = [row for group in groups for row in group]
                samples += len(rows)
                tokens += sum(len(r[S.COMPLETION_IDS]) for r in rows)
                seconds = max(time.monotonic() - started, 1e-9)
                bar.advance(len(groups), f"{samples / seconds:.1f} samples/s  {tokens / seconds:.0f} tok/s")
                if pending_groups >= config.groups_per_shard:
                    writer.commit(progress=progress)
                    pending_groups = 0
        except BaseException:
            # The buffer holds whole finished batches only: keep them (Ctrl-C, a crash in sampling).
            if pending_groups:
                try:
                    writer.commit(progress=progress)
                except Exception:
                    pass
            raise
    writer.progress = progress


def _sample_batch(
    config: CollectConfig, plan: _Plan, batch: list[int], backend: Backend
) -> tuple[list[list[dict]], dict]:
    """The groups of one batch of prompt indices, rewarded, and the batch's counters."""
    started = time.monotonic()
    samples = backend.generate([plan.prompt_ids[i] for i in batch], config.num_samples, config.sampling,
                               seeds=[derive_seed(config.seed, i) for i in batch])
    flat = [(i, k, sample) for i, group in zip(batch, samples) for k, sample in enumerate(group)]
    rewards, reward_stats = score_many(
        plan.task, [plan.texts[i] for i, _, _ in flat], [s.text for _, _, s in flat],
        [plan.items[i].fields for i, _, _ in flat], timeout_s=config.reward_timeout_s,
    )
    finish: dict[str, int] = {}
    groups: dict[int, list[dict]] = {i: [] for i in batch}
    for (i, k, sample), reward in zip(flat, rewards):
        finish[sample.finish_reason] = finish.get(sample.finish_reason, 0) + 1
        groups[i].append(make_row(
            group_id=plan.group_ids[i], sample_index=k, prompt=plan.texts[i], prompt_ids=plan.prompt_ids[i],
            completion=sample.text, completion_ids=sample.completion_ids, behavior_logprobs=sample.logprobs,
            reward=reward, finish_reason=sample.finish_reason, behavior=config.behavior_name,
            policy_version=config.policy_version, task=plan.task.name, meta=plan.items[i].fields,
        ))
    stats = {"reward": reward_stats, "finish_reasons": finish, "collect_seconds": time.monotonic() - started}
    return [groups[i] for i in batch], stats


def _add_stats(total: dict, batch: dict) -> None:
    """Add one batch's counters to the manifest's stats (committed with the batch's groups)."""
    total["reward"] = merge_reward_stats(total.get("reward") or {}, batch["reward"])
    finish = total.setdefault("finish_reasons", {})
    for reason, count in batch["finish_reasons"].items():
        finish[reason] = finish.get(reason, 0) + count
    total["collect_seconds"] = round(total.get("collect_seconds", 0.0) + batch["collect_seconds"], 3)


# --------------------------------------------------------------------------------------------
# planning


def _plan(config: CollectConfig, task: Task, tokenizer) -> _Plan:
    num_prompts = config.num_prompts
    if config.prompts is None and num_prompts is None:
        num_prompts = DEFAULT_BUILTIN_PROMPTS
    items = get_prompts(task, n=num_prompts, seed=config.seed, split=config.split, prompts_file=config.prompts,
                        prompt_column=config.prompt_column)
    group_ids = {i: group_id(task.name, item) for i, item in enumerate(items)}
    if len(set(group_ids.values())) != len(items):
        raise UserError("the task's prompts repeat an id; group ids must be unique per prompt instance")
    indices = [i for i in range(len(items)) if i % config.num_shards == config.shard_index]
    if not indices:
        raise UserError(
            f"slice {config.shard_index} of {config.num_shards} holds none of the {len(items)} prompts; use fewer --num-shards"
        )
    texts, prompt_ids = {}, {}
    for i in indices:
        texts[i] = render_prompt(items[i], tokenizer, config.chat_template)
        # A chat template writes its own special tokens (BOS ...); plain text gets the tokenizer's.
        templated = not isinstance(items[i].prompt, str) and config.chat_template
        prompt_ids[i] = tokenizer(texts[i], add_special_tokens=not templated)["input_ids"]
        if not prompt_ids[i]:
            raise UserError(f"prompt {items[i].id!r} is empty after tokenization")
    batches = [indices[start:start + config.batch_size] for start in range(0, len(indices), config.batch_size)]
    return _Plan(task=task, items=items, indices=indices, texts=texts, prompt_ids=prompt_ids,
                 group_ids={i: group_ids[i] for i in indices}, batches=batches)


def group_id(task_name: str, item: PromptItem) -> str:
    """The group id of a prompt instance: the task name, then the item's id (unique within its source)."""
    prefix = f"{task_name}-"
    return item.id if item.id.startswith(prefix) else prefix + item.id


def _prompts_label(config: CollectConfig, task: Task) -> str:
    return str(config.prompts) if config.prompts is not None else f"builtin:{task.name}/{config.split}"


# --------------------------------------------------------------------------------------------
# resume


def _existing_manifest(out: Path) -> dict | None:
    """The manifest at `out`, or None when there is no dataset yet (absent or empty directory)."""
    if not out.exists() or (out.is_dir() and not any(out.iterdir())):
        return None
    return read_manifest(out)


def _check_same_options(out: Path, manifest: dict, identity: dict) -> None:
    previous = (manifest.get(S.M_SOURCE) or {}).get("options")
    if (manifest.get(S.M_SOURCE) or {}).get("command") != "collect" or not isinstance(previous, dict):
        raise UserError(f"{out} was not written by `collect`, so it cannot be resumed; choose another --out")
    differ = [
        f"{name} {previous.get(name)!r} -> {value!r}" for name, value in identity.items() if previous.get(name) != value
    ]
    if differ:
        raise UserError(
            f"--resume of {out} with different options ({'; '.join(differ)}); rerun with the dataset's options or choose another --out"
        )


def _check_progress(writer: DatasetWriter, plan: _Plan, batches_done: int) -> None:
    """The committed groups must be exactly those of the first `batches_done` batches."""
    expected = {plan.group_ids[i] for batch in plan.batches[:batches_done] for i in batch}
    if expected != writer.committed_group_ids:
        raise DataError(
            f"{writer.path}: the committed groups do not match the recorded progress ({batches_done} batches); "
            "the dataset was changed by hand? collect it again into a new --out"
        )


def _backend_name(backend: Backend) -> str:
    return {"transformers": "hf", "vllm": "vllm"}.get(backend.engine, backend.engine)


def _plain(value):
    return str(value) if isinstance(value, Path) else value


# --------------------------------------------------------------------------------------------
# progress display
