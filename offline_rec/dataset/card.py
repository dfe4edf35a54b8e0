"""The dataset card (README.md) for the Hub, rendered from a manifest (the model card of a trained policy:
offline_rec/hub/model_card.py, which shares `with_front_matter` and `as_prose`).

It starts with YAML front matter that the Hub reads (license, tags, configs, features, ...)
and `datasets.load_dataset(folder)` honours: the `configs` entry lists the shards the manifest
lists (so manifest.json and uncommitted shards are not read as data) and `dataset_info.features`
gives the exact column types (`List(int32)`, not the `int64` a JSON reader would guess).

Why the config is named after the data (`data-<content id>`, see `data_config`): `datasets`
caches a folder under `<folder name>/<config name>/<version>/<hash of the card's YAML>`. With a
`configs` block it hashes the data-file PATTERNS of the YAML, never the files (checked in
datasets 5.2, `LocalDatasetModuleFactory` and `BuilderConfig.create_config_id`), so two datasets
in folders of the same name, or one folder rewritten in place, shared one cache entry and the
second load returned the first one's rows. The config name heads the config id, a part of
that path in every layout `datasets` has used (its builder still looks for the 2.13 and 2.15
layouts, both with it); naming the config after the content of the listed shards gives each
distinct dataset its own entry whatever `datasets` does or does not hash.

Rendering is a pure function of its arguments; only `write_dataset_card` and
`refresh_dataset_card` touch the disk.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pyarrow as pa

from offline_rec import schema as S

TAGS = ["offline-rl", "rl", "logprobs", "llm"]
TASK_CATEGORIES = ["reinforcement-learning", "text-generation"]
DEFAULT_LICENSE = "other"
NOT_RECORDED = "not recorded"
PLACEHOLDER_REPO = "ORG/NAME"
DATA_CONFIG_PREFIX = "data-"
CONTENT_ID_HEX_DIGITS = 16  # 64 bits: a collision between two datasets of one folder name is out of reach

LOGPROBS_MEANING = {
    S.LOGPROBS_SAMPLED: "the processed distribution actually sampled from (temperature, top-k and top-p applied)",
    S.LOGPROBS_RAW: "the model's raw softmax, before temperature and truncation "
                    "(the sampled distribution only at temperature 1 without top-k/top-p)",
    S.LOGPROBS_RECOMPUTED: "recomputed after sampling by teacher-forcing a scoring model",
    "unknown": "not recorded: importance ratios computed from them may be biased",
}

# The Hub's `size_categories` buckets: (upper bound on rows, label).
_SIZE_CATEGORIES = (
    (1_000, "n<1K"),
    (10_000, "1K<n<10K"),
    (100_000, "10K<n<100K"),
    (1_000_000, "100K<n<1M"),
    (10_000_000, "1M<n<10M"),
    (100_000_000, "10M<n<100M"),
    (1_000_000_000, "100M<n<1B"),
    (10_000_000_000, "1B<n<10B"),
    (100_000_000_000, "10B<n<100B"),
    (1_000_000_000_000, "100B<n<1T"),
)


# --------------------------------------------------------------------------------------------
# front matter


def _feature(dtype: pa.DataType) -> str | dict:
    """A column's type in the Hub's `dataset_info.features` YAML notation."""
    if pa.types.is_list(dtype):
        return {"list": _feature(dtype.value_type)}
    return {
        pa.string(): "string",
        pa.int32(): "int32",
        pa.int8(): "int8",
        pa.float32(): "float32",
    }[dtype]


def dataset_features() -> list[dict]:
    """`dataset_info.features`: one `{name, dtype}` or `{name, list}` entry per column, in schema order."""
    features = []
    for name, dtype, _, _ in S.COLUMNS:
        feature = _feature(dtype)
        features.append({"name": name, **(feature if isinstance(feature, dict) else {"dtype": feature})})
    return features


def size_category(rows: int) -> str:
    for bound, label in _SIZE_CATEGORIES:
        if rows < bound:
            return label
    return "n>1T"


def content_id(manifest: dict) -> str:
    """Hex digest identifying the rows of a dataset: sha256 over its schema version and listed shards.

    Each shard enters with its path, row count and sha256, so the id changes whenever a
    producer writes different rows (a re-collect, a re-import, `filter`, `reward`) and is
    equal for byte-identical datasets, wherever they lie.
    """
    shards = [[s.get("path"), s.get("rows"), s.get("sha256")] for s in manifest.get(S.M_SHARDS) or []]
    payload = json.dumps({"schema_version": manifest.get(S.M_SCHEMA_VERSION), "shards": shards}, sort_keys=True)
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:CONTENT_ID_HEX_DIGITS]


def data_config(manifest: dict) -> dict:
    """The card's one `configs` entry: named after `content_id`, the default, the listed shards as the train split."""
    return {
        "config_name": DATA_CONFIG_PREFIX + content_id(manifest),
        "default": True,
        "data_files": [{"split": "train", "path": [s["path"] for s in manifest.get(S.M_SHARDS) or []]}],
    }


def dataset_info(manifest: dict) -> dict:
    """`dataset_info`: the exact features, under the config name of `data_config` (else `datasets` drops them)."""
    return {"config_name": data_config(manifest)["config_name"], "features": dataset_features()}


def card_front_matter(manifest: dict, license: str | None = None) -> dict:
    """The dataset card's YAML front matter as a dict (license: the argument, else the manifest's, else 'other')."""
    rows = int((manifest.get(S.M_TOTALS) or {}).get("rows") or 0)
    return {
        "license": license or manifest.get("license") or DEFAULT_LICENSE,
        "tags": list(TAGS),
        "task_categories": list(TASK_CATEGORIES),
        "size_categories": [size_category(rows)],
        "configs": [data_config(manifest)],
        "dataset_info": dataset_info(manifest),
    }


def split_front_matter(text: str) -> tuple[dict, str]:
    """(front matter as a dict, body) of a card; ValueError when it has no `---` delimited YAML header."""
    import yaml

    if not text.startswith("---\n"):
        raise ValueError("card does not start with YAML front matter ('---')")
    end = text.find("\n---\n", 4)
    if end < 0:
        raise ValueError("card front matter is not closed by '---'")
    return yaml.safe_load(text[4:end + 1]) or {}, text[end + 5:].lstrip("\n")


def with_front_matter(front: dict, body: str) -> str:
    """`body` under the YAML front matter `front` (the `---` delimited header the Hub reads)."""
    import yaml

    return f"---\n{yaml.safe_dump(front, sort_keys=False, allow_unicode=True)}---\n\n{body}"


# --------------------------------------------------------------------------------------------
# dataset card


def as_prose(value) -> str:
    """A manifest value for prose: code-formatted, or 'not recorded' when absent."""
    if value is None or value == "":
        return NOT_RECORDED
    if isinstance(value, (dict, list)):
        return f"`{json.dumps(value, sort_keys=True, default=str)}`"
    return f"`{value}`"


def _behavior_section(behavior: dict) -> str:
    sampling = behavior.get("sampling") or {}
    source = behavior.get("logprobs_source") or "unknown"
    lines = [
        f"- model: {as_prose(behavior.get('model'))}, revision {as_prose(behavior.get('revision'))}, "
        f"dtype {as_prose(behavior.get('dtype'))}",
        f"- engine: {as_prose(behavior.get('engine'))}, version {as_prose(behavior.get('engine_version'))}",
        "- sampling: "
        + ", ".join(
            f"{k} {as_prose(sampling.get(k))}" for k in ("temperature", "top_p", "top_k", "max_new_tokens", "seed")
        ),
        f"- `behavior_logprobs` are log-probabilities of: `{source}`, "
        f"{LOGPROBS_MEANING.get(source, 'see the producer of the data')}",
        f"- tokenizer hash: {as_prose(behavior.get('tokenizer_hash'))}",
    ]
    known = {"model", "revision", "dtype", "engine", "engine_version", "sampling", "logprobs_source", "tokenizer_hash"}
    lines += [f"- {key}: {as_prose(value)}" for key, value in behavior.items() if key not in known]
    return "\n".join(lines)


def _task_section(task: dict) -> str:
    lines = [f"- task: {as_prose(task.get('name'))}", f"- reward function: {as_prose(task.get('reward_function'))}"]
    lines += [f"- {key}: {as_prose(value)}" for key, value in task.items() if key not in ("name", "reward_function")]
    return "\n".join(lines)


def render_dataset_card(manifest: dict, license: str | None = None, repo_id: str | None = None) -> str:
    """The README.md of a dataset: front matter, provenance, totals, columns and how to load it."""
    totals = manifest.get(S.M_TOTALS) or {}
    version = manifest.get(S.M_SCHEMA_VERSION)
    name = repo_id or PLACEHOLDER_REPO
    front = card_front_matter(manifest, license)
    columns = "\n".join(
        f"| `{n}` | {_feature_text(t)} | {'yes' if nullable else 'no'} | {meaning} |"
        for n, t, nullable, meaning in S.COLUMNS
    )
    totals_row = " | ".join(str(n) for n in (totals.get("rows", 0), totals.get("groups", 0),
                                             totals.get("completion_tokens", 0), len(manifest.get(S.M_SHARDS) or [])))
    stats = manifest.get(S.M_STATS) or {}
    stats_lines = "\n".join(f"- {key}: {as_prose(value)}" for key, value in stats.items()) or "- none recorded"
    body = f"""# Offline RL trajectories with behavior log-probabilities

Logged responses of a behavior policy, grouped per prompt, with the log-probability of every
sampled token under the distribution it was sampled from and a scalar reward, in the offline-rec
trajectory format, schema version `{version}` (the Hub tag `schema-v{version}` marks a revision in
this format). One row is one response; rows sharing `group_id` answer the same prompt instance.

- license: `{front["license"]}`
- created: {as_prose(manifest.get(S.M_CREATED_AT))}
- complete: {as_prose(manifest.get(S.M_COMPLETE, True))}
- how it was made: {as_prose(manifest.get(S.M_SOURCE) or None)}

## Totals

| rows | groups | completion tokens | shards |
|---|---|---|---|
| {totals_row} |

Counters kept while producing it:
{stats_lines}

## Task and reward

{_task_section(manifest.get(S.M_TASK) or {})}

## Behavior policy

{_behavior_section(manifest.get(S.M_BEHAVIOR) or {})}

## Columns

| column | type | nullable | meaning |
|---|---|---|---|
{columns}

## Loading

With `datasets`:
```python
from datasets import load_dataset
ds = load_dataset("{name}", split="train")
ds = load_dataset("{name}", split="train", revision="schema-v{version}")  # pinned to this format
```

With `polars`:
```python
import polars as pl
df = pl.scan_parquet("hf://datasets/{name}/data/*.parquet").collect()
```

With `offline-rec` (checks the sha256 of every shard against `manifest.json`):
```bash
offline-rec pull {name} --out my-dataset
offline-rec train --data hf://datasets/{name} --model MODEL --algorithm rec-oneside-nois --out runs/x
```

`manifest.json` holds the full provenance and the sha256 of every shard.

## Personal data

Prompts and completions are published exactly as they were logged. Check them for personal
data before sharing.
"""
    return with_front_matter(front, body)


def _feature_text(dtype: pa.DataType) -> str:
    feature = _feature(dtype)
    return f"list<{feature['list']}>" if isinstance(feature, dict) else feature


def write_dataset_card(
    path: str | os.PathLike, manifest: dict, license: str | None = None, repo_id: str | None = None
) -> Path:
    """Write (atomically) the dataset card of the dataset directory `path`; returns the card's path."""
    from offline_rec.files import atomic_write_text

    out = Path(path) / S.CARD_FILE
    atomic_write_text(out, render_dataset_card(manifest, license, repo_id))
    return out


def _pinned(front: dict, manifest: dict) -> bool:
    """Whether front matter makes `datasets.load_dataset` read exactly the manifest's shards under their content id."""
    return front.get("configs") == [data_config(manifest)] and front.get("dataset_info") == dataset_info(manifest)


def _read_card(card: Path) -> tuple[dict | None, str, str | None]:
    """(front matter, body, None) of an existing card, or (None, "", why it is unreadable)."""
    import yaml

    try:
        front, body = split_front_matter(card.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError, yaml.YAMLError) as e:
        return None, "", (str(e).strip().splitlines() or [type(e).__name__])[0]
    if not isinstance(front, dict):
        return None, "", "the front matter is not a YAML mapping"
    return front, body, None


def card_problem(path: str | os.PathLike, manifest: dict) -> str | None:
    """Why the card of dataset `path` lets `datasets.load_dataset(path)` serve stale rows, or None when it cannot.

    A card whose `configs` is not `data_config(manifest)` (one written by an older offline-rec,
    for an earlier version of the data, or edited) makes `datasets` key its cache on the folder
    name and that YAML alone. A folder without a card is not a problem: `datasets` then hashes
    the files themselves. Reads only the card (no `datasets` import, nothing written).
    """
    card = Path(path) / S.CARD_FILE
    if not card.is_file():
        return None
    front, _, unreadable = _read_card(card)
    if unreadable:
        return f"its {S.CARD_FILE} has no readable YAML front matter ({unreadable})"
    if not _pinned(front, manifest):
        return f"its {S.CARD_FILE} does not name the manifest's shards and their content id (an older or edited card)"
    return None


def refresh_dataset_card(path: str | os.PathLike, manifest: dict, repo_id: str | None = None) -> bool:
    """Make the card of dataset `path` pin `manifest`'s shards; returns whether the card was (re)written.

    A card with front matter keeps everything but its `configs` and `dataset_info` (a pulled
    card keeps the license and text it was pushed with); a missing or unreadable card is
    rendered anew. A card that already pins the manifest is left byte for byte.
    """
    from offline_rec.files import atomic_write_text

    card = Path(path) / S.CARD_FILE
    front, body, _ = _read_card(card) if card.is_file() else (None, "", None)
    if front is not None and _pinned(front, manifest):
        return False
    if front is not None:
        text = with_front_matter({**front, "configs": [data_config(manifest)], "dataset_info": dataset_info(manifest)},
                                  body)
    else:
        text = render_dataset_card(manifest, repo_id=repo_id)
    atomic_write_text(card, text)
    return True
