"""`datasets.load_dataset(folder)` as a user calls it, against a cache private to the test, next to a plain
pyarrow read of the shards the manifest lists: the two must give the same rows in the same order.

    use_private_datasets_cache(monkeypatch, tmp_path / "hf-datasets")
    assert rows_by_datasets(folder) == rows_by_pyarrow(folder)

`old_style_card(manifest)` is the card earlier versions wrote, which let `datasets` serve another
folder's cached rows. The cache is set the way a user sets it (HF_DATASETS_CACHE) and, since `datasets` reads that
variable when it is imported, also on `datasets.config`, which `load_dataset` reads at each call.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pyarrow.parquet as pq
import yaml

from offline_rec import schema as S
from offline_rec.dataset.card import render_dataset_card, split_front_matter


def use_private_datasets_cache(monkeypatch, folder: str | os.PathLike) -> Path:
    import datasets.config

    folder = Path(folder)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(folder))
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", folder)
    return folder


def rows_by_datasets(path: str | os.PathLike) -> list[dict]:
    """The rows of `datasets.load_dataset(path, split="train")`: the loading call the README promises."""
    import datasets

    return datasets.load_dataset(str(path), split="train").to_list()


def rows_by_pyarrow(path: str | os.PathLike) -> list[dict]:
    """The rows of the shards manifest.json lists, in its order, read with pyarrow alone."""
    path = Path(path)
    manifest = json.loads((path / S.MANIFEST_FILE).read_text(encoding="utf-8"))
    return [row for shard in manifest[S.M_SHARDS] for row in pq.read_table(path / shard["path"]).to_pylist()]


def old_style_card(manifest: dict, license: str = "mit") -> str:
    """The card earlier versions wrote: config `default` over `data/*.parquet`, features under `default`."""
    front, body = split_front_matter(render_dataset_card(manifest))
    front["license"] = license
    front["configs"] = [{"config_name": "default", "data_files": [{"split": "train", "path": "data/*.parquet"}]}]
    front["dataset_info"] = {"features": front["dataset_info"]["features"]}
    return f"---\n{yaml.safe_dump(front, sort_keys=False)}---\n\n{body}"
