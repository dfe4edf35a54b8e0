"""Score a dataset with a sequence-classification reward model (`offline-rec reward --reward-model`).

What is scored: the conversation the reward model expects. Where a row's meta holds the chat
`messages` of its request (a list of {"role", "content"}; `import --keep-messages`), the conversation is
those messages and the completion as the assistant's turn; where the meta also says
"messages_include_completion": true (a multi-turn episode's row: its messages are the whole
conversation, every turn and the final answer), the messages alone; otherwise it is the logged prompt
as the user's turn and the completion as the assistant's (schema.py's META_MESSAGES). It is rendered
with the REWARD MODEL's chat template (not the policy's) and tokenized without adding special tokens
(the template writes them). A reward model without a chat template scores the text
`prompt + completion` exactly as logged, tokenized with the tokenizer's own special tokens. A sequence longer
than the reward model's context scores null (counted "too_long").

Two phases, so a run killed at any moment (kill -9 included) loses at most one input shard of work:

1. Scoring, resumable: each input shard's scores (by this process, or by N spawned workers with
   `data_parallel_size`, worker k taking shards k, k + N, ..., one GPU each where there are GPUs, or by
   N Ray actors with `ray_address`, to which this process hands the shards' rows one at a time) are
   written to SCORES/scores-NNNNN.parquet (temporary name, fsync, rename), SCORES = the hidden folder
   `.OUT.reward-scores` beside OUT. A rerun of the same command skips the shards already scored, so
   every row is scored once. SCORES/run.json names the input shards (sha256) and the model settings; a
   rerun with other settings is refused rather than mixing scores.
2. Writing: OUT is written atomically (a hidden folder renamed at the end) from the input and the scores,
   normalized per dataset (`zscore`: (s - mean) / std over the non-null scores) or not (`none`); SCORES is
   then removed. The manifest's task block records the model, its revision, the label, the dtype and the
   normalization (with its mean and std).
"""

from __future__ import annotations

import json
import math
import os
import shutil
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.format import DatasetWriter, open_dataset
from offline_rec.dataset.validate import check_dataset_for_use
from offline_rec.devices import visible_gpus
from offline_rec.errors import DataError, UserError, one_of, require_extra
from offline_rec.files import atomic_write_json, fsync_dir
from offline_rec.rewards.config import NORMALIZATIONS
from offline_rec.rewards.sequence_classifier import DEFAULT_MAX_BATCH_TOKENS

SCORE_CHUNK_ROWS = 1024  # rows rendered and scored at once within a shard
SCORES_SCHEMA = pa.schema([(S.GROUP_ID, pa.string()), (S.SAMPLE_INDEX, pa.int32()), ("score", pa.float64())])


def scores_dir(out: Path) -> Path:
    """The hidden folder beside OUT holding the per-shard scores of an unfinished run."""
    return out.with_name(f".{out.name}.reward-scores")


def _message_ok(message: object) -> bool:
    """A chat message a template can render: a role, and text content (None or absent where it calls tools)."""
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        return False
    content = message.get("content")
    return isinstance(content, str) or (content is None and bool(message.get("tool_calls")))


def conversation(prompt: str, completion: str, meta: str) -> list[dict]:
    """The chat messages a reward model with a chat template scores for one row (see the module docstring)."""
    try:
        fields = json.loads(meta)
    except (json.JSONDecodeError, TypeError):
        fields = None
    messages = fields.get(S.META_MESSAGES) if isinstance(fields, dict) else None
    if not (isinstance(messages, list) and messages and all(_message_ok(m) for m in messages)):
        messages = [{"role": "user", "content": prompt}]
    elif fields.get(S.META_MESSAGES_INCLUDE_COMPLETION) is True:
        return messages
    return [*messages, {"role": "assistant", "content": completion}]


def scoring_ids(tokenizer, prompt: str, completion: str, meta: str) -> list[int]:
    """The token ids the reward model scores for one row (see the module docstring)."""
    if not getattr(tokenizer, "chat_template", None):
        return tokenizer(prompt + completion)["input_ids"]
    text = tokenizer.apply_chat_template(conversation(prompt, completion, meta), tokenize=False)
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def _run_key(dataset, identity: dict) -> dict:
    return {"input": str(Path(dataset.path).resolve()),
            "shards": [shard.get("sha256") for shard in dataset.manifest[S.M_SHARDS]],
            **{k: identity[k] for k in ("model", "revision", "label", "dtype", "engine")}}


def _open_scores(folder: Path, key: dict) -> None:
    """Create SCORES, or check that the one there belongs to this run; drop temporaries of a killed write."""
    run_file = folder / "run.json"
    if run_file.exists():
        try:
            found = json.loads(run_file.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError):
            found = None
        if found != key:
            raise UserError(f"{folder} holds the scores of an unfinished run with other inputs or model settings; "
                            f"rerun that command to finish it, or delete {folder}")
        for tmp in folder.glob(".*.tmp"):
            tmp.unlink()
        return
    folder.mkdir(parents=True, exist_ok=True)
    atomic_write_json(run_file, key)


SHARD_COLUMNS = [S.GROUP_ID, S.SAMPLE_INDEX, S.PROMPT, S.COMPLETION, S.META]  # what scoring reads of a row


def _read_shard(shard: Path) -> pa.Table:
    try:
        return pq.read_table(shard, columns=SHARD_COLUMNS)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{shard}: cannot read Parquet shard ({e}); run `offline-rec validate`") from None


def _score_shard(shard: Path, scorer, max_batch_tokens: int, bar=None) -> pa.Table:
    return _score_rows(_read_shard(shard), scorer, max_batch_tokens, bar)


def _score_rows(table: pa.Table, scorer, max_batch_tokens: int, bar=None) -> pa.Table:
    """One shard's scores (SCORES_SCHEMA), SCORE_CHUNK_ROWS rows rendered and scored at a time."""
    parts = []
    for batch in table.to_batches(max_chunksize=SCORE_CHUNK_ROWS):
        rows = batch.to_pylist()
        seqs = [scoring_ids(scorer.tokenizer, r[S.PROMPT], r[S.COMPLETION], r[S.META]) for r in rows]
        fits = [i for i, seq in enumerate(seqs) if seq and (scorer.max_length is None or len(seq) <= scorer.max_length)]
        values = scorer.score([seqs[i] for i in fits], max_batch_tokens)
        scores: list[float | None] = [None] * len(rows)
        for i, value in zip(fits, values):
            scores[i] = value
        parts.append(pa.table({S.GROUP_ID: [r[S.GROUP_ID] for r in rows],
                               S.SAMPLE_INDEX: [r[S.SAMPLE_INDEX] for r in rows], "score": scores},
                              schema=SCORES_SCHEMA))
        if bar is not None:
            bar.advance(len(rows))
    return pa.concat_tables(parts) if parts else SCORES_SCHEMA.empty_table()


def _commit_scores(table: pa.Table, path: Path) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    pq.write_table(table, tmp)
    with open(tmp, "rb") as f:
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)


def _score_in_workers(shards: list[Path], score_files: list[Path], shard_rows: list[int], bar, workers: int,
                      options: dict) -> None:
    """Score the shards not scored yet in `workers` spawned processes (worker k: shards k, k + N, ...); the bar
    follows the committed score files. A worker that fails leaves what it committed for the next run."""
    import multiprocessing
    import time

    devices = _worker_devices(workers)
    context = multiprocessing.get_context("spawn")
    processes = [context.Process(target=_score_worker, daemon=True,
                                 args=([str(p) for p in shards[k::workers]], [str(p) for p in score_files[k::workers]],
                                       devices[k], options)) for k in range(workers)]
    for process in processes:
        process.start()
    seen = {path for path in score_files if path.exists()}
    try:
        while any(process.is_alive() for process in processes):
            time.sleep(0.2)
            for path, rows in zip(score_files, shard_rows):
                if path not in seen and path.exists():
                    seen.add(path)
                    bar.advance(rows)
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()
            process.join()
    failed = [k for k, process in enumerate(processes) if process.exitcode != 0]
    if failed:
        raise UserError(f"reward worker {failed[0]} failed (exit code {processes[failed[0]].exitcode}); the scores "
                        f"committed so far are kept in {score_files[0].parent}: run the same command to continue")


def _worker_devices(workers: int) -> list[str | None]:
    """Worker k's GPU (round robin over the visible ones), or None on a CPU."""
    gpus = visible_gpus()
    return [gpus[k % len(gpus)] if gpus else None for k in range(workers)]


def _score_worker(shards: list[str], score_files: list[str], device: str | None, options: dict) -> None:
    """One data-parallel worker: its own model on its own GPU, its shards' scores committed one by one."""
    if device is not None:  # before torch or vLLM initialise CUDA: this process sees its GPU only
        os.environ["CUDA_VISIBLE_DEVICES"] = device
    scorer, max_batch_tokens = _worker_scorer(options)
    for shard, path in zip(shards, score_files):
        if not Path(path).exists():
            _commit_scores(_score_shard(Path(shard), scorer, max_batch_tokens), Path(path))


def _worker_scorer(options: dict) -> tuple:
    """A data-parallel worker's (reward model, max_batch_tokens), from the options its coordinator passed."""
    from offline_rec.rewards.sequence_classifier import load_reward_model

    options = dict(options)
    max_batch_tokens = options.pop("max_batch_tokens")
    return load_reward_model(options.pop("model"), **options), max_batch_tokens


RAY_SHARDS_IN_FLIGHT = 2  # shards handed to each Ray worker at once: the next one waits while one is scored


def _score_on_ray(shards: list[Path], score_files: list[Path], shard_rows: list[int], bar, workers: int,
                  options: dict, address: str) -> None:
    """Score the shards not scored yet on `workers` Ray actors (one GPU each where the cluster has GPUs). This
    process reads each shard, hands its rows to the actor with the fewest in flight, and commits the scores that
    come back, so the actors need no access to this machine's files and the score files are those of a local
    run. A failure leaves what was committed for the next run."""
    from collections import deque

    from offline_rec.ray_cluster import RayCluster

    todo = deque((shard, path, rows) for shard, path, rows in zip(shards, score_files, shard_rows)
                 if not path.exists())
    with RayCluster(address, what="reward worker", failure=UserError) as cluster:
        actors = cluster.start(partial(_RayScorer, options), workers, gpus_per_actor=1)
        pending: dict = {}

        def submit(rank: int) -> None:
            shard, path, rows = todo.popleft()
            pending[actors[rank].call.remote("score", _read_shard(shard))] = (rank, path, rows)

        try:
            for _ in range(RAY_SHARDS_IN_FLIGHT):
                for rank in range(workers):
                    if todo:
                        submit(rank)
            while pending:
                for ref in cluster.wait(list(pending)):
                    rank, path, rows = pending.pop(ref)
                    _commit_scores(cluster.get(ref), path)
                    bar.advance(rows)
                    if todo:
                        submit(rank)
        except UserError as error:
            raise UserError(f"{error.message}; the scores committed so far are kept in {score_files[0].parent}: "
                            f"run the same command to continue") from None


class _RayScorer:
    """One Ray actor's reward model (held by ray_cluster's actor host, in the actor's process)."""

    def __init__(self, options: dict, rank: int):
        self.scorer, self.max_batch_tokens = _worker_scorer(options)

    def score(self, rows: pa.Table) -> pa.Table:
        return _score_rows(rows, self.scorer, self.max_batch_tokens)


def normalization(scores: list[float | None], kind: str) -> tuple[float, float]:
    """(mean, std) to apply as (s - mean) / std: (0, 1) for "none"; over the non-null scores for "zscore"
    (population std; a dataset of equal scores gets std 1, so its scores all become 0)."""
    if kind == "none":
        return 0.0, 1.0
    values = [s for s in scores if s is not None]
    if not values:
        return 0.0, 1.0
    mean = math.fsum(values) / len(values)
    std = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / len(values))
    return mean, (std if std > 0 else 1.0)


def score_with_reward_model(
    src: str | Path,
    out: str | Path,
    model: str,
    label: str | None = None,
    normalize: str = "none",
    dtype: str | None = "auto",
    max_batch_tokens: int = DEFAULT_MAX_BATCH_TOKENS,
    groups_per_shard: int = 256,
    progress: bool = True,
    scorer=None,
    backend: str = "hf",
    data_parallel_size: int = 1,
    ray_address: str | None = None,
) -> dict:
    """Write SRC with each row's reward set by reward model `model` to a new dataset OUT (see the module
    docstring); a rerun after a kill continues. `backend`: hf (transformers) or vllm (vLLM's pooling runner).
    `scorer` (a loaded `RewardModel`) skips loading `model`. `data_parallel_size` N > 1: N worker processes
    (spawned; one GPU each where there are GPUs) score the shards i with i mod N = their index. `ray_address`
    ("auto": the running cluster): the N workers are Ray actors instead (N >= 1), fed shard by shard by this
    process, which commits their scores; a Ray connection this process had before the call is left open.
    Returns {"out", "rows", "groups", "rewarded", "null", "scored_now", "resumed", "mean", "std"}."""
    from offline_rec.progress import ProgressBar
    from offline_rec.rewards.sequence_classifier import load_reward_model, reward_model_identity

    if normalize not in NORMALIZATIONS:
        raise one_of("normalization", normalize, NORMALIZATIONS)
    if max_batch_tokens < 1:
        raise UserError(f"--max-batch-tokens must be at least 1, got {max_batch_tokens}")
    out = Path(out)
    if out.exists():
        raise UserError(f"output {out} already exists; choose another --out")
    check_dataset_for_use(src)
    dataset = open_dataset(src, require_complete=True)
    if data_parallel_size < 1:
        raise UserError(f"--data-parallel-size must be >= 1, got {data_parallel_size}")
    if ray_address:  # refused before the scores folder is made
        require_extra("--ray-address", "ray", "ray")
    if scorer is not None and (data_parallel_size > 1 or ray_address):
        raise UserError("a loaded reward model is one scorer: --data-parallel-size and --ray-address load their own")
    if scorer is not None:
        identity = {"model": scorer.name, "revision": scorer.revision, "label": scorer.label, "dtype": scorer.dtype,
                    "engine": scorer.engine}
    else:
        identity = reward_model_identity(model, label=label, dtype=dtype, backend=backend)
    folder = scores_dir(out)
    _open_scores(folder, _run_key(dataset, identity))

    score_files = [folder / f"scores-{i:05d}.parquet" for i in range(len(dataset.shard_paths))]
    shard_rows = [int(shard["rows"]) for shard in dataset.manifest[S.M_SHARDS]]
    done_rows = sum(rows for rows, f in zip(shard_rows, score_files) if f.exists())
    with ProgressBar("reward", total=dataset.num_rows, done=done_rows, unit="rows", enabled=progress) as bar:
        worker_options = dict(model=model, label=label, dtype=dtype, backend=backend, max_batch_tokens=max_batch_tokens)
        if ray_address:
            _score_on_ray(dataset.shard_paths, score_files, shard_rows, bar, data_parallel_size, worker_options,
                          ray_address)
        elif data_parallel_size == 1:
            scorer = scorer or load_reward_model(model, label=label, dtype=dtype, backend=backend)
            for shard, path in zip(dataset.shard_paths, score_files):
                if not path.exists():
                    _commit_scores(_score_shard(shard, scorer, max_batch_tokens, bar), path)
        else:
            _score_in_workers(dataset.shard_paths, score_files, shard_rows, bar, data_parallel_size, worker_options)

    tables = [pq.read_table(path) for path in score_files]
    scored = pa.concat_tables(tables) if tables else SCORES_SCHEMA.empty_table()
    scores = scored.column("score").to_pylist()
    mean, std = normalization(scores, normalize)
    reward_model = {**{k: identity[k] for k in ("model", "revision", "label", "dtype", "engine")},
                    "normalize": normalize, "mean": mean, "std": std, "data_parallel_size": data_parallel_size}
    task_block = {**{k: v for k, v in dataset.task.items() if k != "previous"},
                  "reward_function": None, "reward_model": reward_model, "previous": dataset.task or None}
    source = {"command": "reward", "input": str(src), "reward_model": model, "label": label, "normalize": normalize,
              "dtype": dtype, "backend": backend, "data_parallel_size": data_parallel_size,
              "ray": bool(ray_address), "input_source": dataset.manifest.get(S.M_SOURCE)}
    ids = scored.column(S.GROUP_ID).to_pylist()
    at = rewarded = 0
    with DatasetWriter(out, behavior=dataset.behavior, task=task_block, source=source,
                       groups_per_shard=groups_per_shard, atomic=True) as writer:
        for group in dataset.iter_groups():
            for row in group:
                if at >= len(ids) or ids[at] != row[S.GROUP_ID]:
                    raise DataError(f"{folder}: the scores do not match {src} (changed since?); delete {folder}")
                score = scores[at]
                row[S.REWARD] = None if score is None else (score - mean) / std
                rewarded += score is not None
                at += 1
            writer.add_group(group)
        if at != len(ids):
            raise DataError(f"{folder}: the scores do not match {src} (changed since?); delete {folder}")
        writer.stats.update({"reward": {"rewarded": rewarded, "null": at - rewarded,
                                        "too_long": sum(s is None for s in scores)}})
    shutil.rmtree(folder, ignore_errors=True)
    return {"out": str(out), "rows": at, "groups": dataset.num_groups, "rewarded": rewarded, "null": at - rewarded,
            "scored_now": at - done_rows, "resumed": done_rows, "mean": mean, "std": std}
