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

1. Scoring, resumable: each input shard's scores (by this process, or by N workers with
   `data_parallel_size`: spawned processes, one GPU each where there are GPUs, or Ray actors with
   `ray_address`; this process hands them the shards' rows, a shard at a time, and commits what comes back) are
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
from collections import deque
from functools import partial
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from offline_rec import schema as S
from offline_rec.dataset.derive import ShardResults, commit_table, open_input, results_dir, source_block
from offline_rec.errors import DataError, UserError, one_of, require_extra
from offline_rec.rewards.config import NORMALIZATIONS
from offline_rec.rewards.scorer import rescored_task, write_scored
from offline_rec.rewards.sequence_classifier import DEFAULT_MAX_BATCH_TOKENS

SCORE_CHUNK_ROWS = 1024  # rows rendered and scored at once within a shard
SCORES_NAME = "reward-scores"  # the per-shard scores of an unfinished run: the hidden folder .OUT.reward-scores
SCORES_SCHEMA = pa.schema([(S.GROUP_ID, pa.string()), (S.SAMPLE_INDEX, pa.int32()), ("score", pa.float64())])


def scores_dir(out: Path) -> Path:
    """The hidden folder beside OUT holding the per-shard scores of an unfinished run."""
    return results_dir(Path(out), SCORES_NAME)


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


SHARD_COLUMNS = [S.GROUP_ID, S.SAMPLE_INDEX, S.PROMPT, S.COMPLETION, S.META]  # what scoring reads of a row


def _read_shard(shard: Path) -> pa.Table:
    try:
        return pq.read_table(shard, columns=SHARD_COLUMNS)
    except (OSError, pa.ArrowException, ValueError) as e:
        raise DataError(f"{shard}: cannot read Parquet shard ({e}); run `offline-rec validate`") from None


class ConversationScorer:
    """A loaded reward model as a `Scorer`: each row's conversation rendered and tokenized (`scoring_ids`), the
    sequences that fit its context scored in token-budget batches, the others null."""

    def __init__(self, model, max_batch_tokens: int):
        self.model, self.max_batch_tokens = model, max_batch_tokens

    def score(self, rows: list[dict]) -> list[float | None]:
        model = self.model
        seqs = [scoring_ids(model.tokenizer, r[S.PROMPT], r[S.COMPLETION], r[S.META]) for r in rows]
        fits = [i for i, seq in enumerate(seqs) if seq and (model.max_length is None or len(seq) <= model.max_length)]
        scores: list[float | None] = [None] * len(rows)
        for i, value in zip(fits, model.score([seqs[i] for i in fits], self.max_batch_tokens)):
            scores[i] = value
        return scores


def _score_shard(shard: Path, scorer: ConversationScorer, bar=None) -> pa.Table:
    return _score_rows(_read_shard(shard), scorer, bar)


def _score_rows(table: pa.Table, scorer: ConversationScorer, bar=None) -> pa.Table:
    """One shard's scores (SCORES_SCHEMA), SCORE_CHUNK_ROWS rows rendered and scored at a time."""
    parts = []
    for batch in table.to_batches(max_chunksize=SCORE_CHUNK_ROWS):
        rows = batch.to_pylist()
        parts.append(pa.table({S.GROUP_ID: [r[S.GROUP_ID] for r in rows],
                               S.SAMPLE_INDEX: [r[S.SAMPLE_INDEX] for r in rows], "score": scorer.score(rows)},
                              schema=SCORES_SCHEMA))
        if bar is not None:
            bar.advance(len(rows))
    return pa.concat_tables(parts) if parts else SCORES_SCHEMA.empty_table()


SHARDS_IN_FLIGHT = 2  # shards handed to each worker at once: the next one waits while one is scored


def _score_on_workers(results: ShardResults, bar, workers: int, options: dict, address: str | None) -> None:
    """Score the shards not scored yet on `workers` workers (offline_rec/workers.py: spawned processes, one GPU
    each where there are GPUs, shared round robin when there are fewer; or Ray actors on the cluster at
    `address`). This process reads each shard, hands its rows to a worker with the fewest in flight, and commits
    the scores that come back, so the workers need no access to this machine's files. A failure leaves what was
    committed for the next run."""
    from offline_rec.workers import start_workers, worker_environments

    todo = deque(results.pending())
    environments = None if address else worker_environments(workers, share_gpus=True)
    try:
        with start_workers(partial(_ShardScorer, options), workers, what="reward worker", failure=UserError,
                           address=address, environments=environments) as pool:
            pending: dict = {}

            def submit(rank: int) -> None:
                shard, path, rows = todo.popleft()
                pending[pool.submit(rank, "score", _read_shard(shard))] = (rank, path, rows)

            for _ in range(SHARDS_IN_FLIGHT):
                for rank in range(workers):
                    if todo:
                        submit(rank)
            while pending:
                for handle in pool.wait(list(pending)):
                    rank, path, rows = pending.pop(handle)
                    commit_table(pool.get(handle), path)
                    bar.advance(rows)
                    if todo:
                        submit(rank)
    except UserError as error:
        raise UserError(f"{error.message}; the scores committed so far are kept in {results.folder}: "
                        f"run the same command to continue") from None


class _ShardScorer:
    """One worker's reward model (held in the worker's process: a child or a Ray actor)."""

    def __init__(self, options: dict, rank: int):
        from offline_rec.rewards.sequence_classifier import load_reward_model

        options = dict(options)
        max_batch_tokens = options.pop("max_batch_tokens")
        self.scorer = ConversationScorer(load_reward_model(options.pop("model"), **options), max_batch_tokens)

    def score(self, rows: pa.Table) -> pa.Table:
        return _score_rows(rows, self.scorer)


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


class StoredScores:
    """The committed per-shard scores read back as a `Scorer`, normalized ((s - mean) / std): row by row in input
    order, a DataError where they do not match the input (changed since they were scored)."""

    def __init__(self, table: pa.Table, normalize: str, folder: Path, src: str | Path):
        self.ids = table.column(S.GROUP_ID).to_pylist()
        self.scores = table.column("score").to_pylist()
        self.mean, self.std = normalization(self.scores, normalize)
        self.folder, self.src = folder, src
        self.at = 0

    def score(self, rows: list[dict]) -> list[float | None]:
        rewards = []
        for row in rows:
            if self.at >= len(self.ids) or self.ids[self.at] != row[S.GROUP_ID]:
                raise self._mismatch()
            score = self.scores[self.at]
            rewards.append(None if score is None else (score - self.mean) / self.std)
            self.at += 1
        return rewards

    def counts(self) -> dict:
        return {"too_long": sum(score is None for score in self.scores)}

    def refusal(self, rows: int, rewarded: int) -> DataError | None:
        return self._mismatch() if self.at != len(self.ids) else None

    def _mismatch(self) -> DataError:
        return DataError(f"{self.folder}: the scores do not match {self.src} (changed since?); delete {self.folder}")


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
    (spawned; one GPU each where there are GPUs) score the shards, fed shard by shard by this process, which
    commits their scores. `ray_address` ("auto": the running cluster): the N workers are Ray actors instead
    (N >= 1); a Ray connection this process had before the call is left open.
    Returns {"out", "rows", "groups", "rewarded", "null", "scored_now", "resumed", "mean", "std"}."""
    from offline_rec.progress import ProgressBar
    from offline_rec.rewards.sequence_classifier import load_reward_model, reward_model_identity

    if normalize not in NORMALIZATIONS:
        raise one_of("normalization", normalize, NORMALIZATIONS)
    if max_batch_tokens < 1:
        raise UserError(f"--max-batch-tokens must be at least 1, got {max_batch_tokens}")
    dataset = open_input(src, out)
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
    identity = {k: identity[k] for k in ("model", "revision", "label", "dtype", "engine")}
    results = ShardResults(dataset, Path(out), SCORES_NAME, identity, what="scores").open()
    done_rows = results.done_rows
    with ProgressBar("reward", total=dataset.num_rows, done=done_rows, unit="rows", enabled=progress) as bar:
        worker_options = dict(model=model, label=label, dtype=dtype, backend=backend, max_batch_tokens=max_batch_tokens)
        if ray_address or data_parallel_size > 1:
            _score_on_workers(results, bar, data_parallel_size, worker_options, ray_address)
        else:
            local = ConversationScorer(scorer or load_reward_model(model, label=label, dtype=dtype, backend=backend),
                                       max_batch_tokens)
            for shard, path, _ in results.pending():
                commit_table(_score_shard(shard, local, bar), path)

    stored = StoredScores(results.read(SCORES_SCHEMA), normalize, results.folder, src)
    reward_model = {**identity, "normalize": normalize, "mean": stored.mean, "std": stored.std,
                    "data_parallel_size": data_parallel_size}
    source = source_block("reward", src, dataset, reward_model=model, label=label, normalize=normalize, dtype=dtype,
                          backend=backend, data_parallel_size=data_parallel_size, ray=bool(ray_address))
    summary = write_scored(dataset, out, stored, task=rescored_task(dataset, reward_function=None,
                                                                     reward_model=reward_model),
                           source=source, batch_rows=SCORE_CHUNK_ROWS, counts=stored.counts, refusal=stored.refusal,
                           groups_per_shard=groups_per_shard)
    results.remove()
    return {"out": str(out), **summary, "scored_now": summary["rows"] - done_rows, "resumed": done_rows,
            "mean": stored.mean, "std": stored.std}
