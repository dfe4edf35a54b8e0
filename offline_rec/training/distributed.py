"""Which distributed backend a run uses: starting it (on GPUs or CPU processes alike), naming it, configuring it.

The backend comes from how the trainer was launched:
`accelerate launch --config_file configs/accelerate/NAME.yaml --num_processes N -m offline_rec train ...`
with NAME one of ddp (DistributedDataParallel), fsdp2 (FSDP version 2), zero2 or zero3 (DeepSpeed).

On a machine without GPUs accelerate 1.16 does not run what such a launch asks for (measured):
a DDP or FSDP launch gives N unrelated one-process runs, `cpu=True` drops the FSDP plugin, and a
DeepSpeed launch reports one process. `make_accelerator` therefore starts the process group over
gloo itself when N CPU processes were launched, and lets accelerate put the asked-for backend on
top of it; from there on the trainer runs the same code on CPU processes and on GPUs.

Per backend (what `configure` sets before `accelerator.prepare`, and why):
  FSDP      version 2 only (parameters are DTensors; version 1 is refused). With gradient_checkpointing
            the plugin's activation checkpointing wraps the decoder layers before they are sharded.
  DEEPSPEED one optimizer step per training step is taken by marking the accumulation boundary on
            the last micro-batch (trainer.py); DeepSpeed's own gradient_accumulation_steps stays 1 so
            that it does not rescale the loss, whose normalization is the trainer's (global token
            count). Gradient clipping is DeepSpeed's, at max_grad_norm.
"""

from __future__ import annotations

import os
import sys

from offline_rec.errors import UserError

# accelerate's names (DistributedType values) of the backends whose model and optimizer state are
# sharded over the processes: their checkpoints are written per rank, and the full model only at the end.
SHARDED_BACKENDS = ("FSDP", "DEEPSPEED")


def launched_backend() -> str | None:
    """"FSDP" or "DEEPSPEED" when `accelerate launch` was given such a config, else None (DDP or one process)."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() == "true":
        return "FSDP"
    if os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true":
        return "DEEPSPEED"
    return None


def is_main_launch_process() -> bool:
    """Whether this process is rank 0 of its launch (RANK as torchrun and accelerate set it; a lone process is),
    before any accelerator exists."""
    return os.environ.get("RANK", "0") in ("0", "")


def import_deepspeed_only_when_used() -> None:
    """Keep DeepSpeed unimported until a DeepSpeed backend imports it.

    accelerate 1.16 imports DeepSpeed, whenever it is installed, each time it unwraps a model
    (`accelerator.unwrap_model`, `get_state_dict`, and transformers' `save_pretrained` through it), only to
    ask whether the model is a DeepSpeedEngine. That import costs ~0.6 s and, on a machine without GPUs,
    prints DeepSpeed's "Setting accelerator to CPU" warning into every train and demo log. No model is a
    DeepSpeedEngine before DeepSpeed was imported (a DeepSpeed backend imports it when the Accelerator
    starts), so accelerate's question is asked of sys.modules instead: same answer, no import.
    """
    import accelerate.utils.other

    accelerate.utils.other.is_deepspeed_available = _deepspeed_imported


def _deepspeed_imported() -> bool:
    return "deepspeed" in sys.modules


def _gpu_available() -> bool:
    import torch

    return torch.cuda.is_available()


def trains_on_gpu(cpu: bool) -> bool:
    """A run with this `cpu` option trains on GPUs (`make_accelerator`): a GPU is present and cpu is false."""
    return not cpu and _gpu_available()


def make_accelerator(cpu: bool, mixed_precision: str):
    """The Accelerator of this run, running the launched backend also when the N processes are on CPU."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    # accelerate keeps its settings in a per-process singleton; train() may run several times in one
    # process (tests, notebooks), and an earlier run's mixed precision must not stick to this one.
    AcceleratorState._reset_state(reset_partial_state=False)
    kwargs = dict(mixed_precision=mixed_precision, step_scheduler_with_optimizer=False)  # one scheduler step per step
    backend = launched_backend()
    if backend == "DEEPSPEED" and cpu and _gpu_available():
        raise UserError("cpu: true under DeepSpeed on a machine with GPUs is not supported (DeepSpeed would put the "
                        "model on the GPU): drop cpu: true, or launch with configs/accelerate/ddp.yaml or fsdp2.yaml")
    if int(os.environ.get("WORLD_SIZE", "1")) > 1 and not trains_on_gpu(cpu):
        PartialState(cpu=True)  # the N processes joined over gloo (MULTI_CPU): DDP as it stands
        if backend == "FSDP":
            # AcceleratorState puts the FSDP plugin only on a GPU-type process group; the group, the
            # device (cpu) and the ranks stay what PartialState made them.
            PartialState._shared_state["distributed_type"] = DistributedType.MULTI_GPU
        # DeepSpeed's branch of AcceleratorState needs cpu=False; DeepSpeed then runs on its CPU
        # accelerator over the same gloo group.
        accelerator = Accelerator(cpu=backend is None, **kwargs)
    else:
        accelerator = Accelerator(cpu=cpu, **kwargs)
    if backend is not None and accelerator.num_processes != int(os.environ.get("WORLD_SIZE", "1")):
        raise UserError(f"accelerate was launched for {backend} with {os.environ.get('WORLD_SIZE')} processes but "
                        f"runs {accelerator.distributed_type.value} with {accelerator.num_processes}")
    if name(accelerator) == "FSDP" and accelerator.state.fsdp_plugin.fsdp_version != 2:
        raise UserError("FSDP version 1 is not supported: launch with configs/accelerate/fsdp2.yaml (fsdp_version: 2)")
    return accelerator


def name(accelerator) -> str:
    """accelerate's name of what runs: NO, MULTI_CPU, MULTI_GPU, FSDP, DEEPSPEED."""
    return accelerator.distributed_type.value


def is_sharded(accelerator) -> bool:
    return name(accelerator) in SHARDED_BACKENDS


def zero_stage(accelerator) -> int | None:
    return accelerator.state.deepspeed_plugin.zero_stage if name(accelerator) == "DEEPSPEED" else None


def describe(accelerator) -> dict:
    """What ran, for summary.json: {"distributed": NAME} plus "fsdp_version" or "zero_stage" where they apply."""
    described = {"distributed": name(accelerator)}
    if described["distributed"] == "FSDP":
        described["fsdp_version"] = accelerator.state.fsdp_plugin.fsdp_version
    if described["distributed"] == "DEEPSPEED":
        described["zero_stage"] = zero_stage(accelerator)
    return described


def settings_line(accelerator) -> str:
    """One line for the settings block: backend, processes, device and process-group backend."""
    kind = name(accelerator)
    label = {"NO": "single process", "MULTI_CPU": "DDP", "MULTI_GPU": "DDP"}.get(kind, kind)
    if kind == "FSDP":
        label = f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
        if accelerator.state.fsdp_plugin.activation_checkpointing:
            label += " with its activation checkpointing"
    elif kind == "DEEPSPEED":
        label = f"DeepSpeed ZeRO-{zero_stage(accelerator)}"
    group = accelerator.state.backend or "none"
    return (f"{label} (accelerate {kind}), {accelerator.num_processes} process(es) on "
            f"{accelerator.device.type}, process group {group}")


def configure(accelerator, gradient_checkpointing: bool, max_grad_norm: float) -> bool:
    """Set the backend's own options before `prepare`; True when it does the activation checkpointing itself."""
    kind = name(accelerator)
    if kind == "FSDP":
        accelerator.state.fsdp_plugin.activation_checkpointing = gradient_checkpointing
        return gradient_checkpointing
    if kind == "DEEPSPEED":
        ds_config = accelerator.state.deepspeed_plugin.deepspeed_config
        ds_config["gradient_accumulation_steps"] = 1
        ds_config["train_micro_batch_size_per_gpu"] = 1  # DeepSpeed requires it; batches are the trainer's
        ds_config.pop("train_batch_size", None)
        ds_config["gradient_clipping"] = float(max_grad_norm)  # 0 = no clipping, as max_grad_norm
    return False
