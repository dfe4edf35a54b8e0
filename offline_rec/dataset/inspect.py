"""Describe a dataset (`offline-rec inspect`): sizes, lengths, rewards, learning signal, provenance, the recipe.

Computed with polars lazy scans over the shards the manifest lists (streaming engine), so the
dataset is never loaded whole. `warnings` lists what the user should know before loading the
folder elsewhere: a card that lets `datasets.load_dataset` serve rows cached for another
dataset (`card_warnings`).
"""

from __future__ import annotations

from pathlib import Path

from offline_rec import schema as S
from offline_rec.dataset.card import card_problem
from offline_rec.dataset.format import SHARD_READ_ERRORS, Dataset, open_dataset
from offline_rec.dataset.recipe_advice import recommend_recipe
from offline_rec.errors import DataError

PERCENTILES = (0.5, 0.9, 0.99)
REWARD_BINS = 10
SUMMARY_KEYS = ("rows", "groups", "group_size_histogram", "tokens", "prompt_length", "completion_length", "reward",
                "all_equal_reward_groups", "all_equal_reward_group_fraction", "signal", "finish_reasons",
                "policy_versions", "behaviors", "recipe")
"""The order of a non-empty dataset's statistics after the manifest's blocks (as `inspect --json` prints them)."""


# The reward with NaN and inf as null: those are counted apart and left out of every statistic
# (`validate` reports them as errors), so that one bad value does not turn the moments into NaN.
_FINITE_REWARD = "_finite_reward"


def _reward_histogram(lf, lo: float | None, hi: float | None, bins: int = REWARD_BINS) -> list[dict]:
    """Equal-width bins over [lo, hi] of the finite rewards, counted by a lazy query; a constant reward: one bin."""
    import polars as pl

    r = pl.col(_FINITE_REWARD)
    if lo is None:
        return []
    if lo == hi:
        n = lf.select(r.drop_nulls().len()).collect(engine="streaming").item()
        return [{"low": lo, "high": hi, "count": int(n)}]
    width = (hi - lo) / bins
    counts = (
        lf.filter(r.is_not_null())
        .select(((r - lo) / width).floor().clip(0, bins - 1).cast(pl.Int32).alias("bin"))
        .group_by("bin").agg(pl.len().alias("n"))
        .collect(engine="streaming")
    )
    by_bin = {int(b): int(n) for b, n in counts.iter_rows()}
    return [{"low": lo + i * width, "high": lo + (i + 1) * width, "count": by_bin.get(i, 0)} for i in range(bins)]


def _learning_signal(groups, reward_mean: float | None, rows: int) -> dict:
    """Which baselines give this data a learning signal (`offline_rec.loss.objective.Objective.baseline`).

    Per baseline, the rows whose advantage is not 0 when the whole dataset is one step: `group`, the
    rows of groups of >= 2 responses whose rewards differ; `step` and `dataset` (the data's mean for
    both: the step's leave-one-out mean tends to it), those plus the singletons whose reward is not
    the mean. A group without a finite reward has no signal under any baseline.
    """
    import polars as pl

    several = groups.filter(pl.col("size") > 1)
    singles = groups.filter((pl.col("size") == 1) & pl.col("rmin").is_not_null())
    group_rows = int(several.filter(pl.col("rmin") != pl.col("rmax"))["size"].sum())
    off_mean = singles.filter(pl.col("rmin") != reward_mean).height if reward_mean is not None else 0
    by_baseline = {"group": group_rows, "step": group_rows + off_mean, "dataset": group_rows + off_mean}
    singleton_groups = groups.filter(pl.col("size") == 1).height
    supported = [name for name, n in by_baseline.items() if n]
    if not supported:
        advice = "no baseline gives this data a learning signal: its rewards are all equal or missing"
    elif singleton_groups and by_baseline["group"] < by_baseline["step"]:
        advice = (f"{singleton_groups} groups hold one response, with no signal under the group baseline: train with "
                  "--set baseline=step (or dataset, or constant with baseline_value) or "
                  "--algorithm topr")
    else:
        advice = "the group baseline (the default) has signal"
    return {"singleton_groups": singleton_groups, "signal_rows_by_baseline": by_baseline,
            "signal_share_by_baseline": {name: n / rows if rows else 0.0 for name, n in by_baseline.items()},
            "supported_baselines": supported, "advice": advice}


def describe_dataset(path: str | Path) -> dict:
    """The statistics `inspect` prints, as a JSON-serializable dict; DataError if a shard is unreadable."""
    import polars as pl

    ds = open_dataset(path)
    _check_shard_schemas(ds)
    try:
        return _describe(ds, path)
    except (pl.exceptions.PolarsError, pl.exceptions.PanicException, OSError) as e:
        # A truncated or corrupt shard surfaces here, from inside the lazy query: name the
        # dataset and the command that locates the damage instead of a polars traceback. Some
        # damaged pages panic in polars' Parquet decoder (PanicException derives from
        # BaseException, not Exception): same message.
        first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataError(
            f"{path}: cannot read the dataset's shards ({first_line}); "
            f"run `offline-rec validate {path}` to locate the damage"
        ) from None


def card_warnings(ds: Dataset) -> list[str]:
    """A warning when `datasets.load_dataset(folder)` may return another dataset's cached rows.

    The check reads the card only. Looking for an actual stale entry in the `datasets` cache
    would mean importing `datasets` (~1 s, and its cache layout), and an entry found could not
    be told from a good one without reading it; the card decides whether one can be served.
    """
    problem = card_problem(ds.path, ds.manifest)
    if problem is None:
        return []
    folder = ds.path.as_posix()
    return [
        f'datasets.load_dataset("{folder}") may return rows cached for another folder named '
        f'"{ds.path.resolve().name}" or for an earlier version of this one: {problem}; load it with '
        f'datasets.load_dataset("parquet", data_files="{folder}/{S.DATA_DIR}/*.parquet", split="train"), '
        f'or rewrite the card (docs/dataset.md of offline-rec, "Loading with datasets")'
    ]


def _check_shard_schemas(ds: Dataset) -> None:
    """DataError naming the first shard whose footer is unreadable or whose columns break the schema.

    Reads only the Parquet footers: a polars scan over such a shard would fail with a message
    that names no shard, or silently cast a wrong type.
    """
    import pyarrow.parquet as pq

    from offline_rec.dataset.validate import schema_issues

    for shard in ds.shard_paths:
        try:
            schema = pq.read_schema(shard)
        except SHARD_READ_ERRORS as e:
            first_line = (str(e).strip().splitlines() or [type(e).__name__])[0]
            raise DataError(
                f"{ds.path}: cannot read the dataset's shards ({shard.relative_to(ds.path)}: {first_line}); "
                f"run `offline-rec validate {ds.path}`"
            ) from None
        issues = schema_issues(schema)
        if issues:
            raise DataError(
                f"{ds.path}: {shard.relative_to(ds.path)}: {issues[0]}; run `offline-rec validate {ds.path}`"
            )


def _describe(ds: Dataset, path: str | Path) -> dict:
    """The statistics of `describe_dataset`: the manifest's blocks, then what the lazy scans of the shards count."""
    base = {
        "path": str(path),
        "schema_version": ds.manifest.get(S.M_SCHEMA_VERSION),
        "complete": ds.manifest.get(S.M_COMPLETE, True),
        "task": ds.task,
        "behavior": ds.behavior,
        "shards": len(ds.shard_paths),
        "warnings": card_warnings(ds),
    }
    if not ds.shard_paths:
        return {**base, "rows": 0, "groups": 0}
    lf = _scan_with_lengths(ds)
    row_stats = _row_stats(lf)
    parts = {**_sizes_and_lengths(row_stats), "reward": _reward_stats(lf, row_stats), **_group_stats(lf, row_stats),
             **_breakdowns(lf)}
    parts["recipe"] = recommend_recipe(parts)
    return {**base, **{key: parts[key] for key in SUMMARY_KEYS}}


def _scan_with_lengths(ds: Dataset):
    """The lazy scan of every shard with each row's prompt, completion and policy lengths and its finite reward."""
    import polars as pl

    return ds.scan().with_columns(
        pl.col(S.PROMPT_IDS).list.len().alias("_prompt_len"),
        pl.col(S.COMPLETION_IDS).list.len().alias("_completion_len"),
        pl.when(pl.col(S.REWARD).is_finite()).then(pl.col(S.REWARD)).alias(_FINITE_REWARD),
    ).with_columns(
        # the policy sampled the completion tokens with loss_mask 1 (all of them where it is null); the
        # rest (a multi-turn episode's template and tool tokens) the environment inserted
        pl.when(pl.col(S.LOSS_MASK).is_null()).then(pl.col("_completion_len"))
        .otherwise(pl.col(S.LOSS_MASK).list.sum()).alias("_policy_len"),
    )


def _row_stats(lf) -> dict:
    """One streaming pass over the rows: counts, token sums, length percentiles, reward moments."""
    import polars as pl

    finite = pl.col(_FINITE_REWARD)
    q = PERCENTILES
    return lf.select(
        pl.len().alias("rows"),
        pl.col("_prompt_len").sum().alias("prompt_tokens"),
        pl.col("_completion_len").sum().alias("completion_tokens"),
        pl.col("_policy_len").sum().alias("policy_tokens"),
        *[pl.col("_prompt_len").quantile(p, "nearest").alias(f"prompt_p{int(p * 100)}") for p in q],
        *[pl.col("_completion_len").quantile(p, "nearest").alias(f"completion_p{int(p * 100)}") for p in q],
        pl.col("_prompt_len").max().alias("prompt_max"),
        pl.col("_completion_len").max().alias("completion_max"),
        finite.mean().alias("reward_mean"),
        finite.std().alias("reward_std"),
        pl.col(S.REWARD).null_count().alias("reward_null"),
        (pl.col(S.REWARD).is_not_null() & finite.is_null()).sum().alias("reward_nonfinite"),
        finite.min().alias("reward_min"),
        finite.max().alias("reward_max"),
    ).collect(engine="streaming").row(0, named=True)


def _sizes_and_lengths(row_stats: dict) -> dict:
    """"rows", "tokens", "prompt_length" and "completion_length" of the summary."""
    def lengths(name: str) -> dict:
        return {**{f"p{int(p * 100)}": row_stats[f"{name}_p{int(p * 100)}"] for p in PERCENTILES},
                "max": row_stats[f"{name}_max"]}

    return {
        "rows": row_stats["rows"],
        "tokens": {
            "prompt": int(row_stats["prompt_tokens"]),
            "completion": int(row_stats["completion_tokens"]),
            "policy": int(row_stats["policy_tokens"]),
            "environment": int(row_stats["completion_tokens"] - row_stats["policy_tokens"]),
        },
        "prompt_length": lengths("prompt"),
        "completion_length": lengths("completion"),
    }


def _reward_stats(lf, row_stats: dict) -> dict:
    return {
        "mean": row_stats["reward_mean"],
        "std": row_stats["reward_std"],
        "null": int(row_stats["reward_null"]),
        "nonfinite": int(row_stats["reward_nonfinite"]),
        "min": row_stats["reward_min"],
        "max": row_stats["reward_max"],
        "histogram": _reward_histogram(lf, row_stats["reward_min"], row_stats["reward_max"]),
    }


def _group_stats(lf, row_stats: dict) -> dict:
    """"groups", the group size histogram, the all-equal groups and the learning signal of the summary."""
    import polars as pl

    finite = pl.col(_FINITE_REWARD)
    groups = (
        lf.group_by(S.GROUP_ID)
        .agg(pl.len().alias("size"), finite.min().alias("rmin"), finite.max().alias("rmax"))
        .collect(engine="streaming")
    )
    size_hist = groups.group_by("size").agg(pl.len().alias("groups")).sort("size")
    all_equal = groups.filter(pl.col("rmin") == pl.col("rmax")).height
    n_groups = groups.height
    return {
        "groups": n_groups,
        "group_size_histogram": {int(r["size"]): int(r["groups"]) for r in size_hist.iter_rows(named=True)},
        "all_equal_reward_groups": all_equal,
        "all_equal_reward_group_fraction": all_equal / n_groups if n_groups else 0.0,
        "signal": _learning_signal(groups, row_stats["reward_mean"], row_stats["rows"]),
    }


def _breakdowns(lf) -> dict:
    """Rows per finish reason, per policy version and per behavior (with its reward and log-prob means)."""
    import polars as pl

    finite = pl.col(_FINITE_REWARD)
    finish = (
        lf.group_by(S.FINISH_REASON).agg(pl.len().alias("n")).collect(engine="streaming").sort("n", descending=True)
    )
    versions = lf.group_by(S.POLICY_VERSION).agg(pl.len().alias("n")).collect(engine="streaming").sort(S.POLICY_VERSION)
    # Per value of the behavior column (logs of several loggers merged): the importance weights need a policy
    # to compare with, so their ESS is `eval --offline`'s (and train's) part of this breakdown.
    behaviors = (
        lf.group_by(S.BEHAVIOR).agg(
            pl.len().alias("rows"), finite.mean().alias("reward_mean"),
            pl.col(S.BEHAVIOR_LOGPROBS).list.sum().sum().alias("logprob_sum"),
            pl.col("_completion_len").sum().alias("tokens"),
        ).collect(engine="streaming").sort(S.BEHAVIOR)
    )
    return {
        "finish_reasons": {r[S.FINISH_REASON]: int(r["n"]) for r in finish.iter_rows(named=True)},
        "policy_versions": {int(r[S.POLICY_VERSION]): int(r["n"]) for r in versions.iter_rows(named=True)},
        "behaviors": {r[S.BEHAVIOR]: {"rows": int(r["rows"]), "reward_mean": r["reward_mean"],
                                      "logprob_mean": r["logprob_sum"] / r["tokens"] if r["tokens"] else None}
                      for r in behaviors.iter_rows(named=True)},
    }
