"""Every option of the commands that check or transform datasets: `validate`, `inspect`, `filter` and `merge`
(and the input / output pair that `reward` shares, offline_rec/rewards/config.py).

Each field carries its flag, help line and default (`offline_rec.options`); the CLI builds the
commands from them and the library functions take the same objects. Light on purpose (no pyarrow):
the CLI imports it to declare its options.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from offline_rec.errors import UserError
from offline_rec.options import argument, option, required


@dataclass(frozen=True)
class InspectConfig:
    """The dataset `offline-rec inspect` describes."""

    dataset: Path = argument(help="Dataset directory.")


@dataclass(frozen=True)
class ValidateConfig:
    """What `offline-rec validate` checks."""

    dataset: Path = argument(help="Dataset directory.")
    no_checksums: bool = option(
        False, "--no-checksums", help="Skip the sha256 check of shards (faster on huge datasets).")


@dataclass(frozen=True)
class DatasetToDataset:
    """The input and output of a command that writes a new dataset from one (filter, reward)."""

    dataset: Path = argument(help="Input dataset (never modified).")
    out: Path = required("--out", "-o", help="New dataset directory (must not exist).")


@dataclass(frozen=True)
class FilterConfig:
    """What `offline-rec filter` drops (the order and the counting are in offline_rec/dataset/filter.py)."""

    drop_truncated: bool = option(
        False, "--drop-truncated",
        help="Drop responses with finish_reason 'length' (the rest of their group stays).",
    )
    drop_all_equal: bool = option(
        False, "--drop-all-equal", help="Drop groups whose rewards are all equal (no learning signal).")
    max_prompt_tokens: int | None = option(
        None, "--max-prompt-tokens", help="Drop groups whose prompt is longer than N tokens.")
    max_completion_tokens: int | None = option(
        None, "--max-completion-tokens", help="Drop whole groups holding a completion longer than N tokens.")
    min_policy_version: int | None = option(
        None, "--min-policy-version", help="Drop responses of older policy versions.")
    max_policy_version: int | None = option(
        None, "--max-policy-version", help="Drop responses of newer policy versions.")
    sample_fraction: float | None = option(
        None, "--sample-fraction", help="Keep this fraction of groups, chosen by a hash of (seed, group id).")
    seed: int = option(0, "--seed", help="Seed of --sample-fraction.")

    def check(self) -> None:
        for name in ("max_prompt_tokens", "max_completion_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise UserError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
        if self.sample_fraction is not None and not 0.0 < self.sample_fraction <= 1.0:
            raise UserError(f"--sample-fraction must be in (0, 1], got {self.sample_fraction}")
        if (self.min_policy_version is not None and self.max_policy_version is not None
                and self.min_policy_version > self.max_policy_version):
            raise UserError(
                f"--min-policy-version {self.min_policy_version} > --max-policy-version {self.max_policy_version}"
            )


@dataclass(frozen=True)
class MergeConfig:
    """What `offline-rec merge` combines, and how."""

    datasets: list[Path] = argument(help="Input datasets (e.g. the slices of one collect); never modified.")
    out: Path = required("--out", "-o", help="New dataset directory (must not exist).")
    groups_per_shard: int = option(
        256, "--groups-per-shard", help="Groups per output shard, for the shards that are rewritten.")
    no_row_checks: bool = option(
        False, "--no-row-checks",
        help="Do not validate the rows of shards linked as they are (train and validate still check the output).",
    )
    join_groups: bool = option(
        False, "--join-groups",
        help="Two inputs, LOGGED FRESH: join FRESH's answers (collect --prompts-from LOGGED) into LOGGED's groups.",
    )
