"""What the demo's stages start from: the behavior policy (the shipped one, built into the cache once if missing), the
logged dataset it collects and its check, and the validation prompts (train-split prompts none of the run trains
on). The experiments (experiments/harness.py) start from the same."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

from offline_rec.demo.config import DemoSettings
from offline_rec.errors import UserError
from offline_rec.files import cache_root


def demo_policy_cache(task: str = "arith") -> Path:
    """Where a missing shipped policy is built: demo-policy/ (arith's) or demo-policy-TASK/ in the cache root
    (`files.cache_root`)."""
    return cache_root() / ("demo-policy" if task == "arith" else f"demo-policy-{task}")


def ensure_demo_policy(progress: bool = True, task: str = "arith", **recipe) -> str:
    """The shipped policy of `task` (`behavior_policy.SHIPPED_POLICIES`); if it is missing, the cached build, built
    now if needed (minutes on a CPU).

    `recipe`: `demo_policy.DemoRecipe` fields for a build (tests use tiny ones; default: the task's shipped recipe).
    The build goes into a temporary sibling folder renamed when complete, so an interrupted build is never used.
    """
    from dataclasses import asdict

    from offline_rec.demo.behavior_policy import build_demo_policy, demo_policy_path, shipped_policy

    try:
        return demo_policy_path(task)
    except UserError:
        pass
    cached = demo_policy_cache(task)
    if (cached / "config.json").is_file():
        return str(cached)
    partial = cached.with_name(cached.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.parent.mkdir(parents=True, exist_ok=True)
    if progress:
        print(f"the shipped {task} policy is missing: building it into {cached} (once, minutes)", file=sys.stderr)
    build_demo_policy(partial, progress=progress, **(recipe or asdict(shipped_policy(task).recipe)))
    partial.rename(cached)
    return str(cached)


def collect_dataset(policy: str, out: Path, settings: DemoSettings, progress: bool) -> Path:
    """The logged dataset: `settings.collect_samples` samples at T=1 per train-split prompt, behavior `demo-policy`."""
    from offline_rec.rollout.collect import CollectConfig, collect

    return collect(CollectConfig(
        model=policy, task=settings.task, reward=settings.reward, chat_template=settings.chat_template, out=out,
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

    collect draws the task's first `num_prompts` train prompts for the seed; these are the ones drawn after them
    with the same seed (a built-in task's draw is prefix-stable), any trained one left out. Being train split, they
    share no pair with the held-out test (or ood) prompts either.
    """
    from offline_rec.tasks.builtin import get_prompts, get_task
    from offline_rec.tasks.prompts import write_prompts

    task = get_task(settings.task)
    trained = {item.id for item in get_prompts(task, n=settings.num_prompts, seed=settings.seed, split="train")}
    drawn = get_prompts(task, n=settings.num_prompts + settings.validation_prompts, seed=settings.seed, split="train")
    return write_prompts([item for item in drawn if item.id not in trained][: settings.validation_prompts], path)
