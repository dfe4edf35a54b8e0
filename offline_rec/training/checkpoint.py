"""Training checkpoints: written atomically, found again on --resume (or by init_from), turned into the final model.

A run directory holds::

    RUN/
      config.yaml            the resolved TrainConfig
      holdout.json           held-out group ids and the dataset paths (for `eval --offline`)
      metrics.jsonl          one JSON object per optimizer step
      tb/                    TensorBoard events (if tensorboard is installed)
      checkpoints/step-000010/
        config.json, model.safetensors, generation_config.json     Hugging Face format
          (LoRA: adapter_config.json + adapter_model.safetensors instead)
        tokenizer files, with the chat template
        trainer_state.json   the data cursor (step, epoch, position, shuffle seed), finished flag
        trainer/             accelerate state: optimizer, lr scheduler, RNG states of every rank
      final/                 the last weights, loadable by AutoModelForCausalLM and vLLM
        adapter/             (LoRA) the adapter; final/ itself holds the merged model
      summary.json

A checkpoint is written into `checkpoints/.step-000010.tmp` and renamed when complete, so a
crash (even kill -9) mid-write leaves only a hidden temporary directory, which `latest_checkpoint`
never returns and `remove_partial` deletes. `final/` is built the same way.

Model weights are saved once per checkpoint. One process or DDP: in Hugging Face format; the
accelerate state hooks drop them from `trainer/` and a resumed run loads them from the HF files.
Sharded backends (FSDP2, DeepSpeed; see distributed.py): each rank writes its own shard of the
weights and of the optimizer state into `trainer/` through accelerate (FSDP2: the sharded state
dict through torch.distributed.checkpoint, `pytorch_model_fsdp_0/` and `optimizer_0/`; DeepSpeed:
the engine's ZeRO checkpoint, `pytorch_model/`), nothing is gathered, and the checkpoint folder
holds the model's config and tokenizer but no weights. The full model is gathered only for
`final/` (`consolidate`, once, at the end) and for checkpoints an evaluation reads. A sharded
checkpoint resumes only under the backend that wrote it (`check_backend`).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from offline_rec.errors import UserError, write_fault
from offline_rec.files import atomic_write_json
from offline_rec.models.versions import (  # noqa: F401  (the run layout names, re-read by callers as ckpt.*)
    FINAL_DIR,
    SUMMARY_FILE,
    TRAINER_STATE_FILE,
    model_policy_version,
    policy_version,
    read_trainer_state,
)
from offline_rec.training import distributed
from offline_rec.training.config import save_config
from offline_rec.training.scheduling import epoch_seed

CHECKPOINTS_DIR = "checkpoints"
ADAPTER_DIR = "adapter"
ACCELERATE_STATE_DIR = "trainer"
CONFIG_FILE = "config.yaml"
HOLDOUT_FILE = "holdout.json"
BASELINE_FILE = "baseline.json"
METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tb"
CONSOLIDATED_DIR = ".consolidated.tmp"  # the gathered model of a sharded run, on its way into final/
# Files whose presence means a folder holds model weights in Hugging Face form.
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors")

_CHECKPOINT_NAME = re.compile(r"^step-(\d+)$")
# Files of a checkpoint that are training state, not part of the model folder.
_TRAINING_ONLY = (TRAINER_STATE_FILE, ACCELERATE_STATE_DIR)


def checkpoint_name(step: int) -> str:
    return f"step-{step:06d}"


def list_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """Complete checkpoints of a run as (step, path), oldest first."""
    root = Path(run_dir) / CHECKPOINTS_DIR
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _CHECKPOINT_NAME.match(path.name)
        if match and (path / TRAINER_STATE_FILE).is_file():
            found.append((int(match.group(1)), path))
    return sorted(found)


def scheduled_checkpoints(run_dir: str | os.PathLike) -> list[tuple[int, Path]]:
    """`list_checkpoints` without those only a stop signal saved (SIGTERM at step 5 of save_every 2: its trainer
    state says `on_schedule` false): the checkpoints a run never stopped has too, whatever stopped this one."""
    return [(step, path) for step, path in list_checkpoints(run_dir)
            if read_trainer_state(path).get("on_schedule", True)]


def latest_checkpoint(run_dir: str | os.PathLike) -> Path | None:
    checkpoints = list_checkpoints(run_dir)
    return checkpoints[-1][1] if checkpoints else None


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A complete checkpoint: `path` itself (RUN/checkpoints/step-N) or a run folder's latest one.

    UserError for anything else, e.g. a `final/` folder, which holds weights but no optimizer state.
    """
    path = Path(path)
    if (path / TRAINER_STATE_FILE).is_file() and (path / ACCELERATE_STATE_DIR).is_dir():
        return path
    latest = latest_checkpoint(path) if path.is_dir() else None
    if latest is None:
        raise UserError(f"{path} is neither a training run with checkpoints nor a {CHECKPOINTS_DIR}/step-N folder "
                        f"(a {FINAL_DIR}/ folder has no optimizer state: start from it with --model instead)")
    return latest


def has_model_weights(path: str | os.PathLike) -> bool:
    """Whether a checkpoint (or model folder) holds weights in Hugging Face form (a sharded run's do not)."""
    return any((Path(path) / name).is_file() for name in WEIGHT_FILES)


def check_backend(trainer_state: dict | None, backend: str, checkpoint) -> None:
    """A checkpoint whose weights and optimizer are sharded (FSDP, DeepSpeed) continues only under the
    backend that wrote it, and a one-process/DDP checkpoint not under a sharded one: their states differ in form."""
    if trainer_state is None:
        return
    saved = trainer_state.get("distributed", "NO")  # checkpoints from before this key: one process or DDP
    sharded = {name for name in (saved, backend) if name in distributed.SHARDED_BACKENDS}
    if sharded and saved != backend:
        raise UserError(f"{checkpoint} was written under {saved} and this run is {backend}: its weights and optimizer "
                        f"state are in {saved}'s form; continue it with the accelerate config it was trained with")


def remove_partial(run_dir: str | os.PathLike) -> None:
    """Delete the temporary directories an interrupted save left behind."""
    run_dir = Path(run_dir)
    for parent in (run_dir, run_dir / CHECKPOINTS_DIR):
        if parent.is_dir():
            for path in parent.glob(".*.tmp"):
                shutil.rmtree(path, ignore_errors=True)


def register_state_hooks(accelerator) -> None:
    """Keep model weights out of accelerate's state: they are saved once, as the HF export."""
    accelerator.register_save_state_pre_hook(lambda models, weights, output_dir: weights.clear())
    accelerator.register_load_state_pre_hook(lambda models, input_dir: models.clear())


def load_optimizer_state(accelerator, optimizer, scheduler, checkpoint_dir: str | os.PathLike) -> None:
    """Continue AdamW from a checkpoint of another run: its moments and step counts, THIS run's settings.

    accelerate restores optimizer, scheduler and RNG states together; the hyper-parameters of the
    param groups (lr, betas, eps, weight decay) and the scheduler are put back to this run's after.
    """
    settings = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
    schedule = scheduler.state_dict()
    try:
        accelerator.load_state(str(Path(checkpoint_dir) / ACCELERATE_STATE_DIR))
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UserError(f"cannot continue the optimizer of {checkpoint_dir} ({e}); "
                        "init_from needs a checkpoint of the same model with the same trainable parameters") from None
    for group, own in zip(optimizer.param_groups, settings):
        group.update(own)
    scheduler.load_state_dict(schedule)


def save_checkpoint(trainer, tokenizer, step: int, trainer_state: dict, with_model: bool = False) -> Path:
    """Write RUN/checkpoints/step-NNNNNN atomically (every rank calls this); prune to the newest keep_last.

    `trainer` (`training.trainer.Trainer`) gives the accelerator, the prepared module `scorer` (whose `.policy` is
    the transformers or peft model) and the config (`out`, `keep_last`). Under a sharded backend the weights stay
    sharded in `trainer/` unless `with_model` (an evaluation will load the checkpoint): then they are also gathered
    into Hugging Face files.
    """
    accelerator = trainer.accelerator
    root = Path(trainer.config.out) / CHECKPOINTS_DIR
    tmp = root / f".{checkpoint_name(step)}.tmp"
    try:
        return _save_checkpoint(trainer, tokenizer, step, trainer_state, with_model, tmp)
    except Exception as error:
        # A refused write (a full disk, a read-only or immutable folder): the half-written checkpoint goes (it would
        # only take space), the earlier ones stay, and --resume continues from the last of them.
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
        fault = write_fault(error, tmp, "the checkpoints saved before are kept; --resume (a rerun of rounds) "
                                        "continues from the last")
        if fault is not None:
            raise fault from None
        raise


def _save_checkpoint(trainer, tokenizer, step: int, trainer_state: dict, with_model: bool, tmp: Path) -> Path:
    accelerator, scorer = trainer.accelerator, trainer.scorer
    run_dir, keep_last = Path(trainer.config.out), trainer.config.keep_last
    final = run_dir / CHECKPOINTS_DIR / checkpoint_name(step)
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    accelerator.wait_for_everyone()
    if with_model or not distributed.is_sharded(accelerator):
        write_model(accelerator, scorer, tokenizer, tmp)
    elif accelerator.is_main_process:
        _write_model_description(accelerator.unwrap_model(scorer).policy, tokenizer, tmp)
    accelerator.save_state(str(tmp / ACCELERATE_STATE_DIR))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        # Written last: its presence is what makes the directory a checkpoint.
        atomic_write_json(tmp / TRAINER_STATE_FILE, {**trainer_state, "distributed": distributed.name(accelerator)})
        if final.exists():  # a re-save of the same step (e.g. the end of a resumed, finished run)
            shutil.rmtree(final)
        os.replace(tmp, final)
        prune_checkpoints(run_dir, keep_last)
    accelerator.wait_for_everyone()
    return final


def write_model(accelerator, scorer, tokenizer, directory: Path) -> None:
    """The policy in Hugging Face form (LoRA: the adapter) and the tokenizer, into `directory` (existing).

    Every rank calls this: under FSDP2 and ZeRO-3 gathering the weights is a collective; the main
    process writes.
    """
    state_dict = accelerator.get_state_dict(scorer)
    if accelerator.is_main_process:
        policy = accelerator.unwrap_model(scorer).policy
        prefix = "policy."
        tied = tied_names(policy)
        policy.save_pretrained(
            directory, safe_serialization=True,
            state_dict={k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix)
                        and k[len(prefix):] not in tied},
        )
        tokenizer.save_pretrained(directory)


def tied_names(model) -> set[str]:
    """Names under which `model` holds a parameter it already holds under an earlier name (a tied lm_head:
    `lm_head.weight` beside `model.embed_tokens.weight`). `save_pretrained` stores a tied weight once by
    finding tensors that share memory; the state dict gathered under FSDP2 or ZeRO-2 holds a separate
    copy per name, so the copies are dropped by name, keeping the name save_pretrained keeps (the first)."""
    seen, tied = set(), set()
    for name, parameter in model.named_parameters(remove_duplicate=False):
        if id(parameter) in seen:
            tied.add(name)
        seen.add(id(parameter))
    return tied


def _write_model_description(policy, tokenizer, directory: Path) -> None:
    """What a sharded checkpoint shows of its model: config (LoRA: adapter config) and tokenizer, no weights."""
    if hasattr(policy, "peft_config"):
        policy.peft_config["default"].save_pretrained(directory)
    else:
        policy.config.save_pretrained(directory)
        if policy.generation_config is not None:
            policy.generation_config.save_pretrained(directory)
    tokenizer.save_pretrained(directory)


def consolidate(accelerator, scorer, tokenizer, run_dir) -> Path:
    """RUN/.consolidated.tmp: the full model of a sharded run gathered from the live shards (every rank
    calls this), for `export_final`; `remove_partial` deletes it if the run dies before."""
    directory = Path(run_dir) / CONSOLIDATED_DIR
    if accelerator.is_main_process:
        shutil.rmtree(directory, ignore_errors=True)
        directory.mkdir(parents=True)
    accelerator.wait_for_everyone()
    write_model(accelerator, scorer, tokenizer, directory)
    accelerator.wait_for_everyone()
    return directory


def prune_checkpoints(run_dir, keep_last: int) -> None:
    """Delete all but the newest `keep_last` checkpoints (0 keeps all)."""
    if keep_last <= 0:
        return
    for _, path in list_checkpoints(run_dir)[:-keep_last]:
        shutil.rmtree(path, ignore_errors=True)


def export_final(checkpoint_dir: str | os.PathLike, run_dir: str | os.PathLike, base_model: str, dtype: str,
                 summary: dict) -> Path:
    """Build RUN/final from a checkpoint (or a sharded run's `consolidate`d model, removed after): the HF
    model folder (LoRA: merged into the base, with the adapter in final/adapter), then summary.json;
    both appear atomically. Main process only."""
    checkpoint_dir, run_dir = Path(checkpoint_dir), Path(run_dir)
    final = run_dir / FINAL_DIR
    tmp = run_dir / f".{FINAL_DIR}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    model_files = [p for p in checkpoint_dir.iterdir() if p.name not in _TRAINING_ONLY]
    if (checkpoint_dir / "adapter_config.json").is_file():
        merged = merge_adapter(base_model, checkpoint_dir, dtype)
        merged.save_pretrained(tmp, safe_serialization=True)
        (tmp / ADAPTER_DIR).mkdir()
        for path in model_files:
            _copy(path, tmp / ADAPTER_DIR / path.name)
            if not path.name.startswith("adapter_"):  # tokenizer files go next to the merged model too
                _copy(path, tmp / path.name)
    else:
        tmp.mkdir()
        for path in model_files:
            _copy(path, tmp / path.name)
    atomic_write_json(run_dir / SUMMARY_FILE, summary)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    if checkpoint_dir.name == CONSOLIDATED_DIR:
        shutil.rmtree(checkpoint_dir)
    return final


def merge_adapter(base_model: str, adapter_dir: str | os.PathLike, dtype: str = "auto"):
    """A fresh copy of the base model (in `dtype`) with the LoRA adapter merged in: a plain transformers model."""
    from peft import PeftModel

    from offline_rec.models.loading import load_model

    base = load_model(base_model, dtype=dtype, device="cpu")
    return PeftModel.from_pretrained(base, str(adapter_dir)).merge_and_unload()


def _copy(source: Path, destination: Path) -> None:
    if source.is_dir():
        shutil.copytree(source, destination)
    else:
        shutil.copy2(source, destination)


def finished_summary(run_dir: Path) -> dict:
    """A finished run resumed: nothing to do, nothing changed."""
    path = run_dir / SUMMARY_FILE
    summary = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {"run_dir": str(run_dir)}
    print(f"{run_dir} is finished ({run_dir / FINAL_DIR}); nothing to do")
    return {**summary, "already_finished": True}


def make_trainer_state(schedule, steps_done: int, metrics: dict, lineage: dict | None = None) -> dict:
    """The data cursor after `steps_done` steps (the next step is the `position`-th group of `epoch`, or row with
    `batching: rows`), and the policy version of the weights: `lineage` (`Trainer.lineage`) gives version_start
    (that of init_from, the checkpoint this run continued, if any; the version is version_start + steps_done),
    init_from, and the updates the optimizer's own state counts (optimizer_steps; optimizer_steps_at_start of
    them came with init_from's AdamW state)."""
    lineage = {"version_start": 0, "init_from": None, "optimizer_steps": None, "optimizer_steps_at_start": 0,
               **(lineage or {})}
    version_start = lineage["version_start"]
    epoch, step_in_epoch = divmod(steps_done, schedule.steps_per_epoch)
    return {
        "step": steps_done,
        "epoch": epoch,
        "position": step_in_epoch * schedule.position_unit,
        "shuffle_seed": epoch_seed(schedule.seed, epoch),
        "steps_per_epoch": schedule.steps_per_epoch,
        "total_steps": schedule.total_steps,
        "finished": steps_done >= schedule.total_steps,
        "data_fingerprint": schedule.data_fingerprint,
        "policy_version_start": version_start,
        "policy_version": version_start + steps_done,
        "init_from": lineage["init_from"],
        "optimizer_steps": lineage["optimizer_steps"],
        "optimizer_steps_at_start": lineage["optimizer_steps_at_start"],
        "metrics": metrics,
    }


def start_run_dir(run_dir: Path, config, datasets, index, schedule, baseline: dict) -> None:
    """Create RUN/ (main process): its config.yaml, holdout.json and baseline.json (what the advantages are
    centred on, with the training rewards' moments: the `dataset` baseline); leftovers of a killed save removed."""
    run_dir.mkdir(parents=True, exist_ok=True)
    remove_partial(run_dir)
    save_config(config, run_dir / CONFIG_FILE)
    atomic_write_json(run_dir / BASELINE_FILE, baseline)
    atomic_write_json(run_dir / HOLDOUT_FILE, {
        "fraction": config.holdout,
        "rule": "sha256(group_id) read as a big-endian 64-bit fraction < fraction",
        "data": list(config.data),  # as given (hf://datasets/... or local paths)
        "datasets": [str(Path(d.path).resolve()) for d in datasets],
        "group_ids": [index.group_ids[g] for g in schedule.holdout_groups],
    })


def policy_lineage(state: dict | None, init_from: Path | None) -> tuple[int, str | None]:
    """(policy version the run started at, the checkpoint it continued) along a line of init_from runs.

    Versions count updates (0 = the base model); a resumed run reads both from its own trainer state.
    """
    if state:
        return state.get("policy_version_start", 0), state.get("init_from")
    if init_from:
        return policy_version(read_trainer_state(init_from)), str(init_from.resolve())
    return 0, None
