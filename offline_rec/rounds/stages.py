"""The stages of one round, each a library command run with the round's options: collect (or the logs that
arrive), train, the choice of the next policy on the validation prompts, the evaluation on the test prompts.

Each stage first looks for its finished output (run_folder.py) and returns it; otherwise it runs, continuing
what a killed run left (collect and eval resume their datasets, train resumes from its last checkpoint).
"""

from __future__ import annotations

import time
from pathlib import Path

from offline_rec import schema as S
from offline_rec.errors import DataError, UserError
from offline_rec.eval.config import EvalConfig
from offline_rec.files import atomic_write_json
from offline_rec.loss.presets import DEFAULT_PRESET
from offline_rec.rollout.backends.base import derive_seed
from offline_rec.rounds.config import RoundsConfig
from offline_rec.rounds.deployment import Deployment
from offline_rec.rounds.prompt_plan import prompt_column, round_prompts, validation_prompts
from offline_rec.rounds.run_folder import CHOICE_FILE, logs_dir, read_json, round_dir
from offline_rec.training.config import TrainConfig, build_config

DATA_DIR = "data"
RUN_DIR = "run"
VALIDATION_DIR = "validation"
EVAL_DIR = "eval"
OOD_EVAL_DIR = "eval-ood"
EVAL_SEED = 0
"""Seeds the choice of the built-in test prompts and their sampling: the same for every round and every run."""
WAIT_POLL_S = 2.0


def data_path(config: RoundsConfig, number: int) -> Path:
    """Where round `number`'s data is: RUN/round-N/data, or DIR/round-N with --logs."""
    return logs_dir(config.logs, number) if config.logs is not None else round_dir(config.out, number) / DATA_DIR


def is_complete(dataset: Path) -> bool:
    """A dataset folder whose writer finished (a complete manifest)."""
    from offline_rec.dataset.format import read_manifest

    if not (dataset / S.MANIFEST_FILE).is_file():
        return False
    return bool(read_manifest(dataset).get(S.M_COMPLETE, True))


def collect_round(config: RoundsConfig, number: int, policy: dict, deployment: Deployment) -> Path:
    """Stage 1: K samples on each of the round's prompts from `policy`, into RUN/round-N/data (continued if a
    run was killed in it; returned as it is when finished)."""
    from offline_rec.rollout.collect import CollectConfig, collect

    out = data_path(config, number)
    if is_complete(out):
        return out
    prompts = round_prompts(config, number)
    collect_config = CollectConfig(
        model=policy["model"], task=config.task, out=out, prompts=str(prompts), prompt_column=prompt_column(config),
        reward=config.reward, backend=config.backend, top_p=config.top_p, top_k=config.top_k,
        max_new_tokens=config.max_new_tokens, dtype=config.dtype, chat_template=config.chat_template,
        num_samples=config.num_samples, temperature=config.temperature, seed=derive_seed(config.seed, number),
        batch_size=config.batch_size, groups_per_shard=config.groups_per_shard, resume=True,
        show_progress=config.show_progress,
    )
    return collect(collect_config, backend=deployment.serve(policy["model"]))


def arrived_logs(config: RoundsConfig, number: int, tokenizer_of, say) -> Path | None:
    """Stage 1 with --logs: DIR/round-N once it is a complete dataset with the policy's tokenizer; None when it has
    not arrived within --wait seconds."""
    from offline_rec.dataset.format import open_dataset
    from offline_rec.models.loading import check_tokenizers

    path = logs_dir(config.logs, number)
    deadline = time.monotonic() + config.wait
    if not is_complete(path) and config.wait:
        say(f"round {number}: waiting up to {config.wait:g} s for {path}")
    while not is_complete(path):
        if time.monotonic() >= deadline:
            return None
        time.sleep(min(WAIT_POLL_S, max(deadline - time.monotonic(), 0.0)))
    try:
        check_tokenizers([open_dataset(path)], tokenizer_of(), config.model)
    except UserError as error:
        raise UserError(f"round {number}: {error.message}") from None
    return path


def round_train_config(config: RoundsConfig, number: int, policy: dict, resume: bool = True) -> TrainConfig:
    """The train config of round `number`: the recipe (--config, --algorithm, --set; default the preset
    `loss.presets.DEFAULT_PRESET`) on the data of rounds max(1, N-W+1)..N, from `policy`'s checkpoint (weights and
    AdamW state) or, for the start model, from --model; every checkpoint kept for the choice; one seed per round.
    `resume` False: the recipe alone, not compared with a training run the round may have started (the check before
    RUN is read)."""
    options = {} if config.recipe is not None or config.algorithm is not None else {"algorithm": DEFAULT_PRESET}
    if config.algorithm is not None:
        options["algorithm"] = config.algorithm
    first = max(1, number - config.replay + 1)
    options.update(
        data=[str(data_path(config, k)) for k in range(first, number + 1)], model=config.model,
        out=str(round_dir(config.out, number) / RUN_DIR), seed=derive_seed(config.seed, number), resume=resume,
        progress=config.show_progress, keep_last=0,
    )
    if policy.get("checkpoint"):
        options["init_from"] = policy["checkpoint"]
    train_config = build_config(config.recipe, options, config.sets)
    if train_config.lora_r:
        raise UserError("rounds trains and deploys full weights: lora_r > 0 is not supported yet")
    return train_config


def train_round(train_config: TrainConfig) -> dict:
    """Stage 3: the training run (`offline_rec.training.loop.train`, resumed from its last checkpoint when a run
    was killed in it); its summary. A finished run is not opened again."""
    from offline_rec.eval.hooks import training_hooks
    from offline_rec.training import checkpoint as ckpt
    from offline_rec.training.loop import train

    run_dir = Path(train_config.out)
    finished = read_json(run_dir / ckpt.SUMMARY_FILE)
    if finished is not None and (run_dir / ckpt.FINAL_DIR).is_dir():
        return finished
    return train(train_config, training_hooks(train_config))


def choose_policy(config: RoundsConfig, number: int, policy: dict, train_config: TrainConfig,
                  deployment: Deployment) -> dict:
    """Stage 4: `policy` (step 0) and every scheduled checkpoint of `train_config`'s run (not one a stop signal
    saved in between: a resumed run chooses among what an uninterrupted one does) decoded greedily on the validation
    prompts (RUN/round-N/validation/step-S, each kept), the best one chosen into choice.json by the rule the demo
    and the experiments use (`eval.selection.choose_checkpoint`, best-validation: the later step on a tie)."""
    from offline_rec.eval.selection import choose_checkpoint
    from offline_rec.models.versions import model_policy_version
    from offline_rec.training import checkpoint as ckpt

    folder = round_dir(config.out, number)
    chosen = read_json(folder / CHOICE_FILE)
    if chosen is not None:
        return chosen
    candidates = [{**policy, "step": 0}]
    for step, path in ckpt.scheduled_checkpoints(Path(train_config.out)):
        if not ckpt.has_model_weights(path) or (path / "adapter_config.json").is_file():
            raise DataError(f"{path} holds no full model weights to sample from (a sharded or LoRA checkpoint)")
        accuracy = validation_accuracy(config, str(path), folder / VALIDATION_DIR / ckpt.checkpoint_name(step),
                                       deployment)
        candidates.append({"model": str(path), "checkpoint": str(path), "policy_version": model_policy_version(path),
                           "step": step, "validation_greedy_accuracy": accuracy})
    choice = choose_checkpoint(candidates, "best-validation", candidates[-1]["model"], config.validation_prompts,
                               train_config.save_every)
    chosen = next(candidate for candidate in candidates if candidate["step"] == choice["step"])
    chosen = {**chosen, "candidates": {c["step"]: c["validation_greedy_accuracy"] for c in candidates},
              "why": choice["why"]}
    atomic_write_json(folder / CHOICE_FILE, chosen)
    return chosen


def validation_accuracy(config: RoundsConfig, model: str, out: Path, deployment: Deployment) -> float:
    """Greedy accuracy of `model` on the validation prompts, evaluated into `out` once (`evaluate_greedy`)."""
    from offline_rec.eval import rollouts

    done = read_json(out / rollouts.SUMMARY_FILE)
    if done is None:
        eval_config = EvalConfig(
            model=model, task=config.task, out=out, prompts=str(validation_prompts(config)),
            prompt_column=prompt_column(config), num_samples=1, reward=config.reward,
            max_new_tokens=config.max_new_tokens, chat_template=config.chat_template, backend=config.backend,
            seed=EVAL_SEED, batch_size=config.batch_size, overwrite=True, show_progress=False,
        )
        done = rollouts.evaluate_greedy(eval_config, deployment.serve(model))
    return done["metrics"]["greedy_accuracy"]


def evaluate_policy(config: RoundsConfig, model: str, out: Path, deployment: Deployment, split: str = "test") -> dict:
    """Stage 5: `model` on the held-out prompts of `split` (test: --test-prompts or the task's test split; or
    ood): greedy, --eval-samples samples at T=1 (pass@k), mean token entropy; its summary (evaluated once)."""
    from offline_rec.eval import rollouts

    done = read_json(out / rollouts.SUMMARY_FILE)
    if done is not None:
        return done
    from_file = config.test_prompts is not None and split == "test"
    eval_config = EvalConfig(
        model=model, task=config.task, out=out, prompts=str(config.test_prompts) if from_file else None,
        prompt_column=config.prompt_column if from_file else None,
        num_prompts=None if from_file else config.eval_prompts, split=split, num_samples=config.eval_samples,
        greedy=True, temperature=1.0, reward=config.reward,
        max_new_tokens=config.max_new_tokens, chat_template=config.chat_template, backend=config.backend,
        seed=EVAL_SEED, batch_size=config.batch_size, entropy=True, resume=True, show_progress=config.show_progress,
    )
    return rollouts.evaluate(eval_config, deployment.serve(model))
