"""How long a demo will take on this machine, from a micro-benchmark of its own model, printed before it starts.

The estimate is measured, not guessed from parameter counts. Three timings of the behavior policy, here,
with the demo's threads:

1. load     loading the model (`models.loading.load_model`), as each stage does once
2. generate one sampled generate call shaped like collect's first batch: min(batch_size, num_prompts) of
            the demo's own prompts (templated as the demo will send them) x the collect samples, at T=1, up
            to max_new_tokens; its seconds per sequence
3. train    one fwd + bwd + AdamW step on a step's rows (`step_rows`: rows_per_step with steps of rows,
            else prompts_per_step x collect samples), the benchmark's prompt + completion tokens repeated to
            fill them, on a throw-away copy of the model

scaled by the planned work (`planned_work`): every generated sequence of collect, the before/after
evaluations (greedy + K samples per held-out prompt), the held-out curve (greedy + one sample per test
prompt and greedy per validation prompt, at every checkpoint) times (2)'s seconds per sequence; the
optimizer steps times (3); the model loads times (1). Saving checkpoints, validation and the report are
left out (seconds). Evaluations decode greedily in smaller calls than collect's, and answers differ in
length from the benchmark's: the estimate is a guide (within a factor of ~2), not a promise.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class Measured:
    """The micro-benchmark's timings, in seconds."""

    load: float
    generate: float
    """One generate call of `sequences` sequences."""
    sequences: int
    train_step: float
    """One optimizer step of `rows` rows of `tokens` tokens each."""
    rows: int
    tokens: int

    @property
    def per_sequence(self) -> float:
        return self.generate / self.sequences


@dataclass(frozen=True)
class Planned:
    """The demo's work, counted from its settings."""

    loads: int
    sequences: int
    steps: int
    checkpoints: int


@dataclass(frozen=True)
class Estimate:
    measured: Measured
    planned: Planned

    @property
    def parts(self) -> dict[str, float]:
        """Estimated seconds of generation, training and model loading."""
        return {"generate": self.planned.sequences * self.measured.per_sequence,
                "train": self.planned.steps * self.measured.train_step,
                "load": self.planned.loads * self.measured.load}

    @property
    def seconds(self) -> float:
        return sum(self.parts.values())

    def line(self) -> str:
        m, p, parts = self.measured, self.planned, self.parts
        return (f"estimate on this machine: about {duration(self.seconds)} (generate {p.sequences} sequences "
                f"~{parts['generate']:.0f} s, train {p.steps} steps ~{parts['train']:.0f} s, {p.loads} model loads "
                f"~{parts['load']:.0f} s); measured: load {m.load:.1f} s, one generate of {m.sequences} sequences "
                f"{m.generate:.1f} s, one train step of {m.rows} rows x {m.tokens} tokens {m.train_step:.1f} s")

    def as_dict(self) -> dict:
        return {"seconds": round(self.seconds, 1), "parts": {k: round(v, 1) for k, v in self.parts.items()},
                "measured": asdict(self.measured), "planned": asdict(self.planned)}


def duration(seconds: float) -> str:
    """"45 s" under two minutes, else "12 min"."""
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def step_rows(settings, train) -> tuple[int, int]:
    """(optimizer steps, rows a step) of a demo with `settings` (a DemoSettings) training with `train` (its
    TrainConfig). Steps of rows (`batching: rows`) count every collected row: the rows of advantage 0 that
    skip_zero_advantage leaves out are known only after collect, so the count is an upper bound."""
    from offline_rec.training.scheduling import steps_per_epoch

    if train.batching == "rows":
        rows = train.rows_per_step
        return -(-settings.num_prompts * settings.collect_samples // rows) * train.epochs, rows
    steps = steps_per_epoch(settings.num_prompts, train.prompts_per_step) * train.epochs
    return steps, train.prompts_per_step * settings.collect_samples


def planned_work(settings, train) -> Planned:
    """The loads, generated sequences, optimizer steps and checkpoints of a demo with `settings` and `train`, as
    run_demo runs it: collect, before, train, the curve (step 0 validated when there are validation prompts,
    then every checkpoint), after."""
    steps, _ = step_rows(settings, train)
    checkpoints = -(-steps // settings.eval_every)  # every eval_every steps, and the last step
    per_eval = settings.eval_prompts * (1 + settings.num_samples)  # greedy + K samples
    per_point = settings.eval_prompts * 2 + settings.validation_prompts  # greedy + one sample; greedy validation
    sequences = (settings.num_prompts * settings.collect_samples + 2 * per_eval + checkpoints * per_point
                 + settings.validation_prompts)
    loads = 1 + 1 + 1 + checkpoints + (1 if settings.validation_prompts else 0) + 1
    return Planned(loads=loads, sequences=sequences, steps=steps, checkpoints=checkpoints)


def measure(policy: str, config, train, task: str) -> Measured:
    """The micro-benchmark (module docstring) of `policy` with the demo's prompts of `task` and its sizes
    (`config`: a DemoSettings; `train`: the run's TrainConfig)."""
    import torch

    from offline_rec.models.loading import load_model, load_tokenizer
    from offline_rec.tasks.builtin import get_prompts, get_task
    from offline_rec.tasks.prompts import render_prompt, uses_chat_template

    tokenizer = load_tokenizer(policy)
    started = time.perf_counter()
    model = load_model(policy)
    load_seconds = time.perf_counter() - started

    items = get_prompts(get_task(task, config.reward), min(config.batch_size, config.num_prompts),
                        seed=config.seed, split="train", chat=uses_chat_template(tokenizer, config.chat_template))
    texts = [render_prompt(item, tokenizer, config.chat_template) for item in items]
    tokenizer.padding_side = "left"  # decoder-only generation continues the last column
    batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
    with torch.random.fork_rng(), torch.no_grad():  # the demo's own sampling seeds stay untouched
        torch.manual_seed(config.seed)
        started = time.perf_counter()
        output = model.generate(**batch, do_sample=True, temperature=1.0, top_k=0, top_p=1.0,
                                max_new_tokens=config.max_new_tokens, num_return_sequences=config.collect_samples,
                                pad_token_id=tokenizer.pad_token_id)
        generate_seconds = time.perf_counter() - started

    _, rows = step_rows(config, train)
    ids = output.repeat(-(-rows // output.shape[0]), 1)[:rows]  # [rows, prompt + completion tokens]
    model.train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-12, weight_decay=0.0)
    started = time.perf_counter()
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    train_seconds = time.perf_counter() - started
    del model, optimizer
    return Measured(load=round(load_seconds, 3), generate=round(generate_seconds, 3), sequences=int(output.shape[0]),
                    train_step=round(train_seconds, 3), rows=rows, tokens=int(ids.shape[1]))


def estimate_demo(policy: str, config, train, task: str) -> Estimate:
    """`measure` scaled by `planned_work`: how long the demo with `config` training with `train` will take on this
    machine."""
    return Estimate(measure(policy, config, train, task), planned_work(config, train))
