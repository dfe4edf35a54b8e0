"""What the demo's stages start from: the behavior policy (the shipped one, built into the cache once if missing), the
logged dataset it collects and its check, and the validation prompts (train-split prompts none of the run trains
on). The experiments (experiments/harness.py) start from the same."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from offline_rec.demo.config import DEMO_TASK, DemoSettings
from offline_rec.errors import UserError
from offline_rec.files import cache_root


def demo_policy_cache() -> Path:
    """Where a missing demo policy is built: demo-policy/ in the cache root (`files.cache_root`)."""
    return cache_root() / "demo-policy"


def ensure_demo_policy(progress: bool = True, **recipe) -> str:
    """The shipped demo policy folder; if it is missing, the cached build, built now if needed (minutes on a CPU).

    `recipe`: `demo_policy.DemoRecipe` fields for a build (tests use tiny ones). The build goes into a
    temporary sibling folder renamed when complete, so an interrupted build is never used.
    """
    from offline_rec.demo.behavior_policy import build_demo_policy, demo_policy_path

    try:
        return demo_policy_path()
    except UserError:
        pass
    cached = demo_policy_cache()
    if (cached / "config.json").is_file():
        return str(cached)
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"the shipped demo policy is missing: building it into {cached} (once, about 2 minutes)", file=sys.stderr)
    build_demo_policy(partial, progress=progress, **recipe)
    partial.rename(cached)
    return str(cached)


def collect_dataset(policy: str, out: Path, settings: DemoSettings, progress: bool) -> Path:
    """The logged dataset: `settings.collect_samples` samples at T=1 per train-split prompt, behavior `demo-policy`."""
    from offline_rec.rollout.collect import CollectConfig, collect

    return collect(CollectConfig(
        model=policy, task=DEMO_TASK, reward=settings.reward, chat_template=settings.chat_template, out=out,
        num_samples=settings.collect_samples, num_prompts=settings.num_prompts, split="train",
        backend=settings.backend, temperature=1.0, max_new_tokens=settings.max_new_tokens, seed=settings.seed,
        batch_size=settings.batch_size, behavior="demo-policy", show_progress=progress,
    ))


def check_dataset(path: str):
    """The validation report; a dataset with errors stops the demo (it would be a bug upstream)."""
    from offline_rec.dataset.validate import validate_dataset

    report = validate_dataset(path)
    if not report.ok:
        first = report.problems[0] if report.problems else None
        detail = f": {first.code} at {first.location}: {first.message}" if first else ""
        raise UserError(f"the collected dataset {path} does not validate ({report.errors} error(s){detail}); "
                        f"run `offline-rec validate {path}` for the full report")
    return report


def write_validation_prompts(path: Path, settings: DemoSettings) -> Path:
    """`settings.validation_prompts` train-split prompts, none of them among the ones `collect_dataset` samples.

    collect draws `arith_prompts(num_prompts, seed)`; these are drawn from a seeded shuffle of the rest of
    the train split. Being train split, they share no (a, b) pair with the held-out test prompts either.
    """
    from offline_rec.tasks.builtin import arith_pairs, arith_prompts
    from offline_rec.tasks.prompts import write_prompts

    trained = {item.id for item in arith_prompts(settings.num_prompts, seed=settings.seed, split="train")}
    shuffled = arith_prompts(len(arith_pairs("train")), seed=settings.seed, split="train")
    return write_prompts([item for item in shuffled if item.id not in trained][: settings.validation_prompts], path)
