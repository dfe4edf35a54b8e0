"""`offline-rec report`: the PNGs are written, and summary.md's numbers are those of metrics.jsonl and
of the evaluations' summary.json; smoothing by hand; bad sources are one-line errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.cli_support import run_cli

from offline_rec.errors import UserError
from offline_rec.eval.report import format_number, read_metrics, report_runs, smooth

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def write_run(path: Path, algorithm: str, losses: list[float], greedy: dict[int, float]) -> Path:
    """A run folder: metrics.jsonl with a loss and batch reward per step and eval/ keys at the `greedy` steps."""
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(f"algorithm: {algorithm}\nlr: 1.0e-4\n")
    lines = []
    for step, loss in enumerate(losses, start=1):
        line = {"step": step, "loss": loss, "reward_mean": 0.25 + 0.01 * step, "clip_fraction": 0.01 * step,
                "kl_behavior": 0.001 * step, "grad_norm": 0.5, "lr": 1e-4, "tokens_per_s": 1000.0}
        if step in greedy:
            line.update({"eval/greedy_accuracy": greedy[step], "eval/accuracy": greedy[step] / 2,
                         "eval/pass@1": greedy[step] / 2, "eval/pass@4": 0.9, "eval/num_prompts": 400,
                         "eval/truncation_rate": 0.1 / step})
        lines.append(json.dumps(line))
    (path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 99, "loss"')  # a line cut by a crash
    return path


def table_rows(markdown: str, heading: str) -> list[list[str]]:
    """The cells of the data rows of the table under `## heading`."""
    section = markdown.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    return [[cell.strip() for cell in row.strip("|").split("|")] for row in rows[2:]]


@pytest.fixture
def sources(tmp_path):
    rec = write_run(tmp_path / "rec", "rec-oneside-nois", [0.5, 0.4, 0.3, 0.35], {2: 0.5, 4: 0.45})
    reinforce = write_run(tmp_path / "reinforce", "reinforce", [0.6, 0.2, 0.1], {3: 0.3})
    before = tmp_path / "before"
    before.mkdir()
    (before / "summary.json").write_text(json.dumps(
        {"kind": "rollout", "metrics": {"greedy_accuracy": 0.41, "accuracy": 0.2, "pass@8": 0.8, "num_prompts": 400}}))
    offline = tmp_path / "offline"
    offline.mkdir()
    (offline / "summary.json").write_text(json.dumps({"kind": "offline", "metrics": {
        "snis": 0.6, "snis_ci_low": 0.5, "snis_ci_high": 0.7, "logged_reward_mean": 0.25, "ess": 90.0}}))
    return rec, reinforce, before, offline


def test_report_writes_plots_and_a_table_matching_the_metrics(tmp_path, sources):
    rec, reinforce, before, offline = sources
    written = report_runs([rec, reinforce, before, offline / "summary.json"], tmp_path / "report")
    assert set(written) == {"training", "eval", "evals", "summary"}
    for name in ("training", "eval", "evals"):
        assert written[name].read_bytes().startswith(PNG_SIGNATURE) and written[name].stat().st_size > 10_000
    markdown = written["summary"].read_text()

    training = table_rows(markdown, "Training runs")
    # columns: run, steps, final loss, final reward_mean, final clip_fraction, final kl_behavior, final grad_norm
    assert training[0][:3] == ["rec (rec-oneside-nois)", "4", "0.3500"]  # the cut line (step 99) is ignored
    assert training[1][:4] == ["reinforce", "3", "0.1000", format_number(0.25 + 0.01 * 3)]
    for run, row in zip((rec, reinforce), training):
        last = read_metrics(run / "metrics.jsonl")[-1]
        assert float(row[2]) == pytest.approx(last["loss"], abs=5e-5)
        assert float(row[4]) == pytest.approx(last["clip_fraction"], abs=5e-5)

    evaluation = {row[0]: row[1:] for row in table_rows(markdown, "Evaluation during training")}
    # rec: greedy 0.5 at step 2, 0.45 at step 4 -> final 0.45, best 0.5 (step 2); reinforce: one evaluation
    assert evaluation["greedy_accuracy"] == ["0.4500", "0.5000 (2)", "0.3000", "0.3000 (3)"]
    # truncation_rate: lower is better -> rec's best is its last, 0.1/4
    assert evaluation["truncation_rate"][:2] == ["0.0250", "0.0250 (4)"]
    assert "num_prompts" not in evaluation  # bookkeeping, not a metric

    side_by_side = {row[0]: row[1:] for row in table_rows(markdown, "Evaluations")}
    assert side_by_side["greedy_accuracy"] == ["0.4100", "-"]
    assert side_by_side["snis"] == ["-", "0.6000"]


def test_only_evaluations_and_only_runs(tmp_path, sources):
    rec, _, before, _ = sources
    assert set(report_runs([before], tmp_path / "a")) == {"evals", "summary"}
    plain = tmp_path / "plain"
    plain.mkdir()
    (plain / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    assert set(report_runs([plain], tmp_path / "b")) == {"training", "summary"}  # no eval/ keys: no eval.png


def test_smoothing_by_hand():
    # weight 0.5: a1 = 0.5*0 + 0.5*1 = 0.5, debiased 0.5 / (1 - 0.5) = 1;
    #             a2 = 0.5*0.5 + 0.5*3 = 1.75, debiased 1.75 / (1 - 0.25) = 7/3
    assert smooth([1.0, 3.0], 0.5) == pytest.approx([1.0, 7 / 3])
    assert smooth([1.0, 3.0], 0.0) == [1.0, 3.0]
    with pytest.raises(UserError):
        smooth([1.0], 1.0)


def test_labels_keep_runs_apart(tmp_path):
    a = write_run(tmp_path / "x" / "run", "opmd", [1.0], {})
    b = write_run(tmp_path / "y" / "run", "opmd", [2.0], {})
    markdown = report_runs([a, b], tmp_path / "r")["summary"].read_text()
    assert [row[0] for row in table_rows(markdown, "Training runs")] == ["x/run (opmd)", "y/run (opmd)"]



def test_cli_report(tmp_path, sources, capsys):
    rec, reinforce, _, _ = sources
    code, out, err = run_cli(capsys, "report", rec, reinforce, "--out", tmp_path / "r", "--smoothing", 0.5)
    assert code == 0, err
    assert "training:" in out and (tmp_path / "r" / "training.png").is_file()


@pytest.mark.parametrize("make, expected", [
    (lambda p: p / "missing", "does not exist"),
    (lambda p: p, "neither a train run folder"),
    (lambda p: (p / "bad.json").write_text("{}") and p / "bad.json", "not an evaluation summary"),
])
def test_cli_report_bad_sources(tmp_path, make, expected, capsys):
    source = make(tmp_path)
    code, _, err = run_cli(capsys, "report", source, "--out", tmp_path / "r")
    assert code == 2 and expected in err and len(err.strip().splitlines()) == 1
