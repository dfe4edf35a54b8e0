"""The dataset format: column names, Arrow types, manifest fields and the schema version.

This module is the single source of truth for what a trajectory dataset looks like on disk.
Everything that reads or writes a dataset imports its names from here.

A dataset is a directory::

    DATASET/
      manifest.json          see `Manifest` below
      README.md              Hub dataset card (YAML front matter)
      data/part-00000.parquet, data/part-00001.parquet, ...

One row is one response (trajectory). All rows of a group live in one shard.
"""

from __future__ import annotations

import pyarrow as pa

SCHEMA_VERSION = "1.0"
SUPPORTED_SCHEMA_VERSIONS = ("1.0",)

MANIFEST_FILE = "manifest.json"
CARD_FILE = "README.md"
DATA_DIR = "data"
SHARD_PATTERN = "part-{index:05d}.parquet"
SHARD_GLOB = "part-*.parquet"

# Column names.
GROUP_ID = "group_id"
SAMPLE_INDEX = "sample_index"
PROMPT = "prompt"
PROMPT_IDS = "prompt_ids"
COMPLETION = "completion"
COMPLETION_IDS = "completion_ids"
BEHAVIOR_LOGPROBS = "behavior_logprobs"
LOSS_MASK = "loss_mask"
REWARD = "reward"
FINISH_REASON = "finish_reason"
BEHAVIOR = "behavior"
POLICY_VERSION = "policy_version"
TASK = "task"
META = "meta"

# (name, Arrow type, nullable, meaning). Order is the on-disk column order.
COLUMNS: tuple[tuple[str, pa.DataType, bool, str], ...] = (
    (GROUP_ID, pa.string(), False, "responses to the same prompt instance share it"),
    (SAMPLE_INDEX, pa.int32(), False, "0..K-1 within the group"),
    (PROMPT, pa.string(), False, "the exact text given to the model (after any chat template)"),
    (PROMPT_IDS, pa.list_(pa.int32()), False, "the prompt's tokens"),
    (COMPLETION, pa.string(), False, "decoded response"),
    (COMPLETION_IDS, pa.list_(pa.int32()), False, "the sampled tokens"),
    (BEHAVIOR_LOGPROBS, pa.list_(pa.float32()), False,
     "log-prob of each sampled token under the distribution actually sampled from"),
    (LOSS_MASK, pa.list_(pa.int8()), True,
     "1 = token produced by the policy, 0 = tool/environment token; null = all ones"),
    (REWARD, pa.float32(), True, "scalar reward; null until rewarded"),
    (FINISH_REASON, pa.string(), False, "stop, length, ..."),
    (BEHAVIOR, pa.string(), False, "which policy sampled it (model id or checkpoint)"),
    (POLICY_VERSION, pa.int32(), False, "that policy's training step (0 = base)"),
    (TASK, pa.string(), False, "task name"),
    (META, pa.string(), False, "task fields as a JSON object, e.g. the reference answer"),
)

COLUMN_NAMES: tuple[str, ...] = tuple(name for name, *_ in COLUMNS)
NON_NULL_COLUMNS: tuple[str, ...] = tuple(name for name, _, nullable, _ in COLUMNS if not nullable)
ARROW_SCHEMA = pa.schema([pa.field(name, dtype, nullable=nullable) for name, dtype, nullable, _ in COLUMNS])

# Meta fields with a meaning of their own, kept by `import --keep-messages` (openai logs):
# - "messages": chat messages (a list of {"role", "content", ...}). Of a single call (or of one call of a
#   --split-episodes episode): its request messages; `reward --reward-model` scores them with the row's
#   completion appended as the assistant's turn. Of a multi-turn episode row: the WHOLE conversation, i.e. the
#   last call's request messages (every earlier turn, tool results included) followed by the last reply as
#   the final assistant turn, with
# - "messages_include_completion": true, so that `reward --reward-model` scores the messages as they are and
#   appends nothing (the episode's completion, replies and inserted turns alike, is in them already).
META_MESSAGES = "messages"
META_MESSAGES_INCLUDE_COMPLETION = "messages_include_completion"

FINISH_STOP = "stop"
FINISH_LENGTH = "length"

# Which distribution `behavior_logprobs` are log-probs of.
LOGPROBS_SAMPLED = "sampled"  # the processed distribution actually sampled from (temperature/top-k/top-p applied)
LOGPROBS_RAW = "raw"  # the model's raw softmax (equal to "sampled" only at temperature 1, no truncation)
LOGPROBS_RECOMPUTED = "recomputed"  # teacher-forced by a scoring model after the fact
LOGPROBS_SOURCES = (LOGPROBS_SAMPLED, LOGPROBS_RAW, LOGPROBS_RECOMPUTED, "unknown")

# Manifest keys (manifest.json is a JSON object).
M_SCHEMA_VERSION = "schema_version"
M_CREATED_AT = "created_at"
M_TOTALS = "totals"  # {"rows", "groups", "completion_tokens"}
M_BEHAVIOR = "behavior"  # provenance, see `behavior_provenance`
M_TASK = "task"  # {"name", "reward_function", ...}
M_SHARDS = "shards"  # [{"path", "rows", "groups", "completion_tokens", "sha256"}]
M_STATS = "stats"  # free-form counters (reward timeouts, rejects, ...)
M_SOURCE = "source"  # how the data came in: collect / import / filter / merge / reward, with arguments
M_COMPLETE = "complete"  # True once the writer finished (a resumable collect leaves it False)


def behavior_provenance(
    *,
    model: str | None = None,
    revision: str | None = None,
    tokenizer_hash: str | None = None,
    dtype: str | None = None,
    engine: str | None = None,
    engine_version: str | None = None,
    temperature: float | None = None,
    top_p: float | None = None,
    top_k: int | None = None,
    max_new_tokens: int | None = None,
    seed: int | None = None,
    logprobs_source: str = "unknown",
    **extra,
) -> dict:
    """The manifest's `behavior` block: which policy sampled the data, how, and what the log-probs are."""
    if logprobs_source not in LOGPROBS_SOURCES:
        raise ValueError(f"logprobs_source must be one of {LOGPROBS_SOURCES}, got {logprobs_source!r}")
    return {
        "model": model,
        "revision": revision,
        "tokenizer_hash": tokenizer_hash,
        "dtype": dtype,
        "engine": engine,
        "engine_version": engine_version,
        "sampling": {
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "max_new_tokens": max_new_tokens,
            "seed": seed,
        },
        "logprobs_source": logprobs_source,
        **extra,
    }
