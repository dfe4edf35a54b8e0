"""The dataset card (README.md): Hub-compatible YAML front matter plus a description, from the manifest."""

from __future__ import annotations

import os
from pathlib import Path

import pyarrow as pa

from offline_rec import schema as S

TAGS = ["offline-rl", "rl", "logprobs", "llm"]


def _feature(dtype: pa.DataType) -> dict | str:
    """A column's type in the Hub's `dataset_info.features` YAML notation."""
    if pa.types.is_list(dtype):
        return {"list": _feature(dtype.value_type)}
    return {
        pa.string(): "string",
        pa.int32(): "int32",
        pa.int8(): "int8",
        pa.float32(): "float32",
    }[dtype]


def card_front_matter(manifest: dict, license: str | None = None) -> dict:
    features = []
    for name, dtype, _, _ in S.COLUMNS:
        f = _feature(dtype)
        features.append({"name": name, **({"list": f["list"]} if isinstance(f, dict) else {"dtype": f})})
    return {
        "license": license or manifest.get("license") or "other",
        "tags": TAGS,
        "configs": [{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}],
        "dataset_info": {
            "features": features,
        },
    }


def render_dataset_card(manifest: dict, license: str | None = None, repo_id: str | None = None) -> str:
    import yaml

    front = yaml.safe_dump(card_front_matter(manifest, license), sort_keys=False)
    totals = manifest.get(S.M_TOTALS, {})
    behavior = manifest.get(S.M_BEHAVIOR, {})
    sampling = behavior.get("sampling", {})
    task = manifest.get(S.M_TASK, {})
    name = repo_id or "ORG/NAME"
    columns = "\n".join(f"| `{n}` | {t} | {'yes' if nl else 'no'} | {m} |" for n, t, nl, m in S.COLUMNS)
    return f"""---
{front}---

# Offline RL trajectories with behavior log-probabilities

Logged responses of a behavior policy, grouped per prompt, with the per-token log-probability of
the distribution each token was sampled from and a scalar reward, in the
[offline-rec](https://pypi.org/project/offline-rec/) trajectory format (schema version
{manifest.get(S.M_SCHEMA_VERSION)}). One row is one response; rows sharing `group_id` answer the
same prompt instance.

## Totals
| rows | groups | completion tokens |
|---|---|---|
| {totals.get('rows', 0)} | {totals.get('groups', 0)} | {totals.get('completion_tokens', 0)} |

## Task and reward
- task: `{task.get('name')}`
- reward function: `{task.get('reward_function')}`

## Behavior policy
- model: `{behavior.get('model')}` (revision `{behavior.get('revision')}`, dtype `{behavior.get('dtype')}`)
- engine: `{behavior.get('engine')}` {behavior.get('engine_version') or ''}
- sampling: temperature {sampling.get('temperature')}, top_p {sampling.get('top_p')}, top_k {sampling.get('top_k')}, max_new_tokens {sampling.get('max_new_tokens')}, seed {sampling.get('seed')}
- log-probs are of: `{behavior.get('logprobs_source')}` (`sampled` = the processed distribution actually sampled from)
- tokenizer hash: `{behavior.get('tokenizer_hash')}`

## Columns
| column | type | nullable | meaning |
|---|---|---|---|
{columns}

## Loading
```python
from datasets import load_dataset
ds = load_dataset("{name}")

import polars as pl
df = pl.scan_parquet("hf://datasets/{name}/data/*.parquet")
```
```bash
offline-rec pull {name} --out my-dataset
offline-rec train --data hf://datasets/{name} --model MODEL --algorithm rec-oneside-nois --out runs/x
```

`manifest.json` holds the full provenance and the sha256 of every shard.

Prompts and completions are published as they were logged: check them for personal data before sharing.
"""


def write_dataset_card(path: str | os.PathLike, manifest: dict, license: str | None = None, repo_id: str | None = None) -> Path:
    from offline_rec.dataset import atomic_write_text

    out = Path(path) / S.CARD_FILE
    atomic_write_text(out, render_dataset_card(manifest, license, repo_id))
    return out

