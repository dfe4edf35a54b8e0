"""What the demo writes and prints: OUT's layout, the stage headers, the report (heldout.png, heldout.md and
`offline-rec report`'s figures) and the final before/after table."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from offline_rec.demo.config import DemoSettings
from offline_rec.errors import UserError

SETTINGS_FILE = "settings.json"
SUMMARY_FILE = "summary.json"
CURVE_PLOT = "heldout.png"
CURVE_TABLE = "heldout.md"
VALIDATION_FILE = "validation-prompts.jsonl"
DEMO_MARK = "offline-rec demo"
"""settings.json's "what": marks a folder an earlier demo wrote (the only kind --overwrite removes)."""


def start_out(out: Path, overwrite: bool, settings: DemoSettings) -> dict:
    """OUT made (an earlier demo's outputs replaced with `overwrite`), its settings.json written; the paths of
    every output, as summary.json lists them."""
    prepare_out(out, overwrite)
    out.mkdir(parents=True, exist_ok=True)
    (out / SETTINGS_FILE).write_text(json.dumps({"what": DEMO_MARK, **asdict(settings)}, indent=2) + "\n")
    from offline_rec.tasks.builtin import get_task

    ood = "ood" in get_task(settings.task).splits  # its held-out prompts one step harder: evaluated before and after
    return {
        "out": str(out),
        "dataset": str(out / "data"),
        "run": str(out / "run"),
        "validation_prompts": str(out / VALIDATION_FILE),
        "before": str(out / "eval" / "before"),
        "after": str(out / "eval" / "after"),
        **({"before_ood": str(out / "eval" / "before-ood"), "after_ood": str(out / "eval" / "after-ood")} if ood
           else {}),
        "report": str(out / "report"),
    }


def prepare_out(out: Path, overwrite: bool) -> None:
    """Refuse a non-empty `out` unless `overwrite` and it holds an earlier demo (its settings.json says so)."""
    if out.exists() and not out.is_dir():
        raise UserError(f"--out {out} is a file; give a directory")
    if not out.is_dir() or not any(out.iterdir()):
        return
    if not overwrite:
        raise UserError(
            f"{out} already exists; choose another --out, or pass --overwrite to replace an earlier demo there"
        )
    try:
        is_demo = json.loads((out / SETTINGS_FILE).read_text()).get("what") == DEMO_MARK
    except (OSError, ValueError, AttributeError):
        is_demo = False
    if not is_demo:
        raise UserError(
            f"{out} is not a folder an earlier demo wrote (no {SETTINGS_FILE}); it is left alone: choose another --out"
        )
    shutil.rmtree(out)


class Stages:
    """Numbered stage headers with their wall-clock seconds (recorded in `seconds`)."""

    def __init__(self, console, total: int):
        self.console, self.total, self.index = console, total, 0
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def run(self, name: str, what: str):
        self.index += 1
        self.console.rule(f"[bold]{self.index}/{self.total} {name}[/bold]: {what}", align="left")
        started = time.monotonic()
        yield
        self.seconds[name] = round(time.monotonic() - started, 1)
        self.console.print(f"[green]done[/green] {name} in {self.seconds[name]:.1f} s")

    def note(self, text: str) -> None:
        from rich.markup import escape

        self.console.print(f"  {escape(text)}")


def headline(metrics: dict, num_samples: int) -> dict:
    """greedy_accuracy, accuracy (at T=1) and pass@K: fractions in [0, 1]."""
    return {"greedy_accuracy": metrics["greedy_accuracy"], "accuracy": metrics["accuracy"],
            f"pass@{num_samples}": metrics[f"pass@{num_samples}"]}


def metrics_line(metrics: dict, num_samples: int) -> str:
    return (f"greedy accuracy {metrics['greedy_accuracy']:.3f}, accuracy at T=1 {metrics['accuracy']:.3f}, "
            f"pass@{num_samples} {metrics[f'pass@{num_samples}']:.3f} ({metrics['num_prompts']} prompts)")


def dataset_line(path: str) -> str:
    from offline_rec.dataset.format import read_manifest

    totals = read_manifest(path)["totals"]
    return (
        f"{totals['rows']} rows in {totals['groups']} groups, {totals['completion_tokens']} completion tokens -> {path}"
    )


def write_report(out: Path, paths: dict, curve: list[dict], settings: DemoSettings, label: str,
                 chosen_step: int) -> dict[str, Path]:
    """`offline_rec.eval.report.report_runs` on the run and the two evaluations, plus the held-out curve."""
    from offline_rec.eval.report import report_runs

    written = dict(report_runs([paths["run"], paths["before"], paths["after"]], out))
    written["heldout"] = plot_heldout_curve(curve, out / CURVE_PLOT, settings, label, chosen_step)
    written["curve_table"] = out / CURVE_TABLE
    written["curve_table"].write_text(curve_markdown(curve, settings, label, chosen_step))
    return written


def curve_markdown(curve: list[dict], settings: DemoSettings, label: str, chosen_step: int) -> str:
    """The held-out curve as a markdown table (heldout.md next to heldout.png); the chosen step is marked."""
    validation = "validation_greedy_accuracy" in curve[0]
    lines = [f"# Held-out accuracy over offline training ({label})", "",
             f"{settings.eval_prompts} test-split prompts; step 0 is the behavior policy. Greedy decoding, and one "
             "sample per prompt at T=1 (the before/after evaluations use "
             f"{settings.num_samples} samples: see summary.md)."
             + (f" Validation: greedy accuracy on {settings.validation_prompts} train-split prompts not trained on."
                if validation else ""),
             f"The demo's result is step {chosen_step} (select={settings.select}), marked *.", "",
             "| step | greedy accuracy | accuracy at T=1 |" + (" validation greedy accuracy |" if validation else ""),
             "|---:|---:|---:|" + ("---:|" if validation else "")]
    for p in curve:
        mark = " *" if p["step"] == chosen_step else ""
        lines.append(f"| {p['step']}{mark} | {p['greedy_accuracy']:.3f} | {p['accuracy']:.3f} |"
                     + (f" {p['validation_greedy_accuracy']:.3f} |" if validation else ""))
    return "\n".join(lines) + "\n"


def plot_heldout_curve(curve: list[dict], path: Path, settings: DemoSettings, label: str, chosen_step: int) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [p["step"] for p in curve]
    figure, axis = plt.subplots(figsize=(6.4, 4.0), layout="constrained")
    axis.plot(steps, [p["greedy_accuracy"] for p in curve], marker="o", label="greedy")
    axis.plot(steps, [p["accuracy"] for p in curve], marker="s", label="one sample at T=1")
    if "validation_greedy_accuracy" in curve[0]:
        axis.plot(steps, [p["validation_greedy_accuracy"] for p in curve], linestyle="--", color="gray",
                  label=f"greedy, {settings.validation_prompts} validation prompts")
    axis.axvline(chosen_step, color="black", linewidth=0.8, linestyle=":", label=f"chosen: step {chosen_step}")
    axis.set_ylim(0, 1)
    axis.set_xlabel("optimizer step (offline: the data never changes)")
    axis.set_ylabel(f"accuracy on {settings.eval_prompts} held-out prompts")
    axis.set_title(f"demo: {label}, {settings.num_prompts} prompts x {settings.collect_samples} samples", fontsize=9)
    axis.grid(True, alpha=0.3)
    axis.legend()
    figure.savefig(path, dpi=120)
    plt.close(figure)
    return path


def print_final_table(console, summary: dict, settings: DemoSettings, label: str) -> None:
    from rich.table import Table

    key = f"pass@{settings.num_samples}"
    table = Table(title=f"held-out test prompts ({settings.eval_prompts}): before and after offline {label}")
    for column in ("metric", "before", "after", "change"):
        table.add_column(column, justify="left" if column == "metric" else "right")
    for name, text in (("greedy_accuracy", "greedy accuracy"), ("accuracy", "accuracy at T=1"), (key, key)):
        b, a = summary["before"][name], summary["after"][name]
        table.add_row(text, f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts")
    if "ood" in summary:
        for name, text in (("greedy_accuracy", "ood greedy accuracy"), ("accuracy", "ood accuracy at T=1")):
            b, a = summary["ood"]["before"][name], summary["ood"]["after"][name]
            table.add_row(text, f"{100 * b:.1f}%", f"{100 * a:.1f}%", f"{100 * (a - b):+.1f} pts")
    console.print(table)
    checkpoint = summary["checkpoint"]
    console.print(f"after = step {checkpoint['step']} of {checkpoint['final_step']}: {checkpoint['why']}")
    console.print(f"{summary['steps']} training steps; total {summary['seconds']:.0f} s ("
                  + ", ".join(f"{k} {v:.0f} s" for k, v in summary["stage_seconds"].items())
                  + f"); report in {summary['paths']['report']}")


def machine_info() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "python": platform.python_version(), "torch": torch.__version__,
            "load_average_1min_at_end": round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None}
