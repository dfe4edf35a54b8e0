"""FSDP2 gradient reduction per micro-batch vs once per step (`no_sync`): step time and gradient memory.

Run under the FSDP2 config (CPU processes over gloo, or GPUs):
    accelerate launch --config_file configs/accelerate/fsdp2.yaml --num_processes 2 -m benchmarks.fsdp_grad_sync
        [--hidden 256 --layers 4 --vocab 4000 --micro-batches 4 --tokens 512 --steps 3]

A Llama of the given size, wrapped by accelerate exactly as the trainer wraps its PolicyScorer,
takes `--steps` timed steps (after one warm-up step; the two modes take turns) of `--micro-batches`
forward/backward passes each, in two modes:
  per-micro-batch  what the trainer does under FSDP: gradients reduce-scattered after every
                   backward and accumulated sharded;
  no_sync          gradient sync off until the last micro-batch: the full gradient is kept
                   unsharded on every rank in between.
Printed per mode (main process): median seconds per step, and the unsharded gradient bytes held
between two micro-batches (measured on the FSDP parameters of rank 0: the memory the per-micro-batch
mode does not need), next to the parameter bytes. Communication per step, counted from the
parameter sizes: every micro-batch all-gathers the parameters in forward and again in backward
(reshard_after_forward), so per-micro-batch sync adds one reduce-scatter per micro-batch where
no_sync has one per step: 3 vs 2 + 1/M transfers of the model per micro-batch.
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time


def held_gradient_bytes(model) -> int:
    """Bytes of unsharded gradients FSDP2 keeps on this rank between micro-batches (no_sync)."""
    from torch.distributed.fsdp import FSDPModule

    total = 0
    for module in model.modules():
        if not isinstance(module, FSDPModule):
            continue
        group = module._get_fsdp_state()._fsdp_param_group
        for fsdp_param in group.fsdp_params if group else ():
            for grad in (getattr(fsdp_param._unsharded_param, "grad", None),
                         getattr(fsdp_param, "unsharded_accumulated_grad", None)):
                if grad is not None:
                    total += grad.numel() * grad.element_size()
    return total


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4000)
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=512, help="tokens per micro-batch (4 rows)")
    parser.add_argument("--steps", type=int, default=3)
    arguments = parser.parse_args(argv)

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from offline_rec.training import distributed
    from offline_rec.training.policy import PolicyScorer

    accelerator = distributed.make_accelerator(cpu=False, mixed_precision="no")
    if distributed.name(accelerator) != "FSDP":
        print(f"launch with configs/accelerate/fsdp2.yaml (this is {distributed.name(accelerator)})", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=arguments.vocab, hidden_size=arguments.hidden, num_hidden_layers=arguments.layers,
                         num_attention_heads=max(arguments.hidden // 64, 1), intermediate_size=4 * arguments.hidden,
                         tie_word_embeddings=False)
    policy = LlamaForCausalLM(config)
    policy.config.use_cache = False
    parameters = sum(p.numel() for p in policy.parameters())
    scorer = PolicyScorer(policy, chunk_size=1024, temperature=1.0)
    optimizer = torch.optim.AdamW(scorer.parameters(), lr=1e-5)
    scorer, optimizer = accelerator.prepare(scorer, optimizer)
    generator = torch.Generator().manual_seed(accelerator.process_index)
    rows, length = 4, arguments.tokens // 4
    batches = [torch.randint(4, arguments.vocab, (rows, length), generator=generator)
               for _ in range(arguments.micro_batches)]
    mask = torch.ones(rows, length, dtype=torch.long, device=accelerator.device)
    scored = torch.ones(rows, length - 1, dtype=torch.bool, device=accelerator.device)

    def step(defer: bool) -> tuple[float, int]:
        started, held = time.perf_counter(), 0
        for i, ids in enumerate(batches):
            last = i == len(batches) - 1
            with accelerator.no_sync(scorer) if defer and not last else contextlib.nullcontext():
                logprobs = scorer(ids.to(accelerator.device), mask, scored)
                accelerator.backward(-logprobs.sum() / logprobs.numel())
            if i == 0:
                held = held_gradient_bytes(scorer)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        accelerator.wait_for_everyone()
        return time.perf_counter() - started, held

    modes = {"per-micro-batch": False, "no_sync": True}
    timed = {mode: [] for mode in modes}
    for defer in modes.values():
        step(defer)  # warm-up
    for _ in range(arguments.steps):  # the modes take turns: a load that drifts hits both alike
        for mode, defer in modes.items():
            timed[mode].append(step(defer))
    results = {mode: (statistics.median(t for t, _ in runs), max(h for _, h in runs)) for mode, runs in timed.items()}
    if accelerator.is_main_process:
        print(f"{distributed.settings_line(accelerator)}; Llama hidden {arguments.hidden} x {arguments.layers} layers, "
              f"vocab {arguments.vocab}: {parameters / 1e6:.1f}M parameters ({parameters * 4 / 2**20:.0f} MiB fp32); "
              f"{arguments.micro_batches} micro-batches of {rows}x{length} tokens per step")
        for mode, (seconds, held) in results.items():
            print(f"  {mode:>15}: {seconds:.3f} s/step (median of {arguments.steps}), unsharded gradients held between "
                  f"micro-batches on rank 0: {held / 2**20:.1f} MiB")
    accelerator.end_training()
    return 0


if __name__ == "__main__":
    sys.exit(main())
