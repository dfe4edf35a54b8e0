"""`offline-rec demo` and the paper-in-miniature benchmark, end to end at toy sizes.

The behavior policy is the shipped demo policy (0.8M parameters, about half of its greedy answers
right), so the toy datasets hold both rewards: `train` refuses data without any learning signal.
These tests check that every stage runs and leaves the outputs it promises, not that learning
happens at these sizes (docs/paper.md and the demo's own run report that).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
from support.cli_support import run_cli
from support.paths import REPO

from offline_rec.errors import UserError

# 8 train prompts x 4 samples, 1 epoch of the demo's steps of rows, 8 rows a step: ceil(rows of nonzero
# advantage / 8) optimizer steps (`nonzero_advantage_rows`), one checkpoint at the end (eval_every 52 > steps).
TOY_ROWS_PER_STEP = 8
TOY = dict(num_prompts=8, num_samples=4, epochs=1, eval_prompts=8, validation_prompts=8, prompts_per_step=4,
           batch_size=8, train_overrides=(("batching", "rows"), ("skip_zero_advantage", True),
                                          ("rows_per_step", TOY_ROWS_PER_STEP)))


def nonzero_advantage_rows(dataset: str) -> int:
    """Rows of the groups whose rewards are not all equal: the rows skip_zero_advantage trains on."""
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset

    return sum(len(group) for group in open_dataset(dataset).iter_groups([S.REWARD])
               if len({row[S.REWARD] for row in group}) > 1)


def toy_steps(summary: dict) -> int:
    return -(-nonzero_advantage_rows(summary["paths"]["dataset"]) // TOY_ROWS_PER_STEP)


@pytest.fixture(scope="module")
def tiny_policy() -> str:
    from offline_rec.demo.behavior_policy import demo_policy_path

    return demo_policy_path()


@pytest.fixture(scope="module")
def demo(tmp_path_factory, tiny_policy):
    from offline_rec.demo.pipeline import run_demo

    out = tmp_path_factory.mktemp("demo") / "out"
    summary = run_demo(out, model=tiny_policy, progress=False, **TOY)
    return out, summary


@pytest.mark.slow  # the module-scoped demo run takes ~20 s on a 2-core machine
def test_every_stage_leaves_its_output(demo):
    from transformers import AutoModelForCausalLM

    from offline_rec.dataset.validate import validate_dataset

    out, summary = demo
    assert validate_dataset(summary["paths"]["dataset"]).ok
    manifest = json.loads((Path(summary["paths"]["dataset"]) / "manifest.json").read_text())
    assert manifest["totals"]["groups"] == 8 and manifest["totals"]["rows"] == 8 * 4

    run = Path(summary["paths"]["run"])
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    steps = toy_steps(summary)
    assert 1 <= steps <= 32 // TOY_ROWS_PER_STEP  # at most all 32 rows trained
    assert [line["step"] for line in lines] == list(range(1, steps + 1))
    model = AutoModelForCausalLM.from_pretrained(summary["paths"]["final_model"])
    assert model.config.vocab_size > 0

    # step 0 is the "before" evaluation; then one point per saved checkpoint (the last step only)
    assert [point["step"] for point in summary["curve"]] == [0, steps]
    assert summary["curve"][0]["greedy_accuracy"] == summary["before"]["greedy_accuracy"]

    for name in ("heldout.png", "training.png", "evals.png", "summary.md"):
        assert (Path(summary["paths"]["report"]) / name).stat().st_size > 0


@pytest.mark.slow
def test_summary_json_has_the_promised_keys(demo):
    out, returned = demo
    summary = json.loads((out / "summary.json").read_text())
    assert summary == json.loads(json.dumps(returned))
    # the default recipe is rec-logged as the preset defines it (no wide clip over it)
    assert summary["algorithm"] == "rec-logged" and summary["algorithm_overrides"] == {}
    assert summary["seed"] == 0 == summary["settings"]["seed"]
    for side in ("before", "after"):
        assert set(summary[side]) == {"greedy_accuracy", "accuracy", "pass@4"}
        assert all(0.0 <= value <= 1.0 for value in summary[side].values())
        # pass@K >= accuracy: a prompt whose K samples include a correct one counts 1 in pass@K
        assert summary[side]["pass@4"] >= summary[side]["accuracy"]
    assert summary["seconds"] > 0
    assert set(summary["stage_seconds"]) == {"policy", "collect", "validate", "before", "train", "after", "report"}
    assert summary["steps"] == toy_steps(summary)
    checkpoint = summary["checkpoint"]
    assert set(checkpoint) == {"select", "step", "final_step", "model", "validation_greedy_accuracy", "why"}
    assert checkpoint["select"] == "best-validation" and checkpoint["final_step"] == summary["steps"]
    assert "validation prompts" in checkpoint["why"] and "test prompts played no part" in checkpoint["why"]
    # the chosen point: highest validation score, the later step on a tie; "after" is that model on the test prompts
    scores = [(p["validation_greedy_accuracy"], p["step"]) for p in summary["curve"]]
    assert (checkpoint["validation_greedy_accuracy"], checkpoint["step"]) == max(scores)
    assert summary["paths"]["chosen_model"] == checkpoint["model"]
    chosen = next(p for p in summary["curve"] if p["step"] == checkpoint["step"])
    assert summary["after"]["greedy_accuracy"] == chosen["greedy_accuracy"]  # greedy: the same prompts, same answers


@pytest.mark.slow
def test_validation_prompts_are_train_split_and_never_trained_on(demo):
    from offline_rec.dataset.format import open_dataset
    from offline_rec.tasks.builtin import arith_split
    from offline_rec.tasks.prompts import load_prompts

    out, summary = demo
    validation = load_prompts(summary["paths"]["validation_prompts"])
    assert len(validation) == TOY["validation_prompts"] == len({item.prompt for item in validation})
    assert all(arith_split(item.fields["a"], item.fields["b"]) == "train" for item in validation)  # not test
    assert all(item.prompt == f"What is {item.fields['a']}+{item.fields['b']}? " for item in validation)
    trained = set(open_dataset(summary["paths"]["dataset"]).to_table(columns=["prompt"]).column("prompt").to_pylist())
    assert len(trained) == TOY["num_prompts"]
    assert not trained & {item.prompt for item in validation}
    # every point of the curve, step 0 (the behavior policy) included, has a validation evaluation on disk
    for point in summary["curve"]:
        folder = out / "run" / "eval-validation" / f"step-{point['step']:06d}"
        written = json.loads((folder / "summary.json").read_text())
        assert written["metrics"]["greedy_accuracy"] == point["validation_greedy_accuracy"]
        assert written["metrics"]["num_prompts"] == TOY["validation_prompts"]


def test_choose_checkpoint_reads_only_validation_scores():
    from offline_rec.demo.pipeline import DemoSettings, choose_checkpoint

    curve = [
        {"step": 0, "model": "policy", "greedy_accuracy": 0.50, "validation_greedy_accuracy": 0.40},
        {"step": 16, "model": "c16", "greedy_accuracy": 0.90, "validation_greedy_accuracy": 0.60},
        {"step": 32, "model": "c32", "greedy_accuracy": 0.70, "validation_greedy_accuracy": 0.70},
        {"step": 48, "model": "c48", "greedy_accuracy": 0.60, "validation_greedy_accuracy": 0.70},
        {"step": 64, "model": "c64", "greedy_accuracy": 0.65, "validation_greedy_accuracy": 0.55},
    ]
    config = DemoSettings(validation_prompts=100)
    # step 16 is best on test, which is never read; 32 and 48 tie on validation: the later one wins
    chosen = choose_checkpoint(curve, config, final_model="run/final")
    assert (chosen["step"], chosen["model"], chosen["final_step"]) == (48, "c48", 64)
    assert chosen["validation_greedy_accuracy"] == 0.70
    assert "100 validation prompts (0.700) among 5 points" in chosen["why"]
    # the last point chosen: the exported final model stands for its checkpoint
    assert choose_checkpoint(curve[:2], config, final_model="run/final")["model"] == "run/final"
    # the behavior policy can win
    assert choose_checkpoint([curve[0], {**curve[4], "validation_greedy_accuracy": 0.3}], config, "f")["step"] == 0
    final = choose_checkpoint(curve, DemoSettings(select="final"), final_model="run/final")
    assert (final["step"], final["model"], final["select"]) == (64, "run/final", "final")


def test_step_lines_carry_a_sparkline_of_the_accuracy_so_far():
    from offline_rec.demo.pipeline import curve_line, sparkline

    # 8 levels over [0, 1]: level = int(7 v + 0.5); 0.5 -> 4 (the fifth glyph), 0.07 -> 0, 0.08 -> 1
    assert sparkline([0.0, 0.07, 0.08, 0.5, 0.93, 1.0]) == "▁▁▂▅██"
    assert sparkline([-0.2, 1.3]) == "▁█"  # clamped to the scale
    assert sparkline([2.0, 3.0, 4.0], low=2.0, high=4.0) == "▁▅█"
    assert sparkline([]) == ""
    curve = [{"step": 0, "greedy_accuracy": 0.0, "accuracy": 0.1},
             {"step": 2, "greedy_accuracy": 0.25, "accuracy": 0.3, "validation_greedy_accuracy": 0.375}]
    assert curve_line(curve) == ("  step 2: held-out greedy accuracy 0.250, accuracy at T=1 0.300, validation greedy "
                                 "accuracy 0.375  held-out greedy so far ▁▃")  # 0.25 * 7 + 0.5 = 2.25 -> level 2
    assert curve_line(curve[:1]) == ("  step 0: held-out greedy accuracy 0.000, accuracy at T=1 0.100  "
                                     "held-out greedy so far ▁")


@pytest.mark.slow
def test_an_existing_output_is_refused_unless_it_is_a_demo_and_overwrite_is_given(demo, tmp_path, tiny_policy):
    from offline_rec.demo.pipeline import run_demo

    out, _ = demo
    with pytest.raises(UserError, match="already exists"):
        run_demo(out, model=tiny_policy, progress=False, **TOY)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a folder an earlier demo wrote"):
        run_demo(foreign, model=tiny_policy, overwrite=True, progress=False, **TOY)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_bad_settings_fail_before_anything_is_written(tmp_path):
    from offline_rec.demo.pipeline import run_demo

    for bad, message in ((dict(epochs=0), "epochs"), (dict(num_samples=1), "num-samples"), (dict(backend="tpu"), "tpu"),
                         (dict(algorithm="ppo"), "ppo"), (dict(select="best-test"), "select must be one of"),
                         (dict(validation_prompts=0), "needs validation prompts"),
                         (dict(validation_prompts=-1, select="final"), "validation-prompts must be >= 0"),
                         (dict(num_prompts=6500, validation_prompts=51), "must be <= 6550"),
                         (dict(lr_schedule="linear"), "lr-schedule")):
        with pytest.raises(UserError, match=message):
            run_demo(tmp_path / "out", model="unused", progress=False, **bad)
    assert not (tmp_path / "out").exists()


def test_a_missing_demo_policy_is_built_once_into_the_cache(tmp_path, monkeypatch):
    import offline_rec.demo.behavior_policy as demo_policy
    from offline_rec.demo.pipeline import demo_policy_cache, ensure_demo_policy

    def missing():
        raise UserError("the demo policy is missing")

    monkeypatch.setattr(demo_policy, "demo_policy_path", missing)
    monkeypatch.setenv("OFFLINE_REC_CACHE", str(tmp_path / "cache"))
    tiny_recipe = dict(steps=1, batch_size=4, eval_prompts=4, eval_samples=2, hidden_size=64, num_heads=2,
                       num_layers=1, intermediate_size=64)
    path = ensure_demo_policy(progress=False, **tiny_recipe)
    assert path == str(tmp_path / "cache" / "demo-policy") == str(demo_policy_cache())
    assert (Path(path) / "config.json").is_file() and (Path(path) / "build_info.json").is_file()
    assert not (tmp_path / "cache" / "demo-policy.partial").exists()

    def no_second_build(*args, **kwargs):
        raise AssertionError("the cached policy must be reused")

    monkeypatch.setattr(demo_policy, "build_demo_policy", no_second_build)
    assert ensure_demo_policy(progress=False) == path


def run_demo_cli(capsys, *argv) -> tuple[int, str]:
    """(exit code, stdout + stderr) of `offline-rec ARGV` run in this process through the entry point."""
    code, out, err = run_cli(capsys, *argv)
    return code, out + err


@pytest.mark.slow
def test_demo_command_runs_a_quick_demo(tmp_path, tiny_policy, capsys):
    out = tmp_path / "cli-demo"
    # --quick takes 4 samples per prompt; 8 prompts (at most 32 rows), 1 epoch of 128-row steps: a single step.
    args = ["demo", "--out", str(out), "--model", tiny_policy, "--quick", "--num-prompts", "8", "--epochs", "1",
            "--eval-prompts", "8", "--default-clip", "--select", "final", "--seed", "3"]
    code, output = run_demo_cli(capsys, *args)
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 1 and summary["settings"]["num_samples"] == 4
    assert summary["algorithm_overrides"] == {} and summary["seed"] == 3
    assert summary["checkpoint"]["select"] == "final" and summary["checkpoint"]["step"] == 1
    assert summary["checkpoint"]["model"] == summary["paths"]["final_model"]
    assert "after = step 1 of 1: the last step (select=final)" in output
    assert "pass@4" in summary["after"]
    code, output = run_demo_cli(capsys, *args)
    assert code == 2 and "--overwrite" in output
    assert run_demo_cli(capsys, *args, "--overwrite")[0] == 0


def test_demo_command_is_listed():
    from typer.testing import CliRunner

    from offline_rec.cli import app

    result = CliRunner().invoke(app, ["demo", "--help"])
    assert result.exit_code == 0
    for option in ("--out", "--backend", "--algorithm", "--wide-clip", "--default-clip", "--quick", "--epochs",
                   "--select", "--seed"):
        assert option in result.output


# --------------------------------------------------------------------------------------------
# benchmarks/paper.py


def _paper():
    spec = importlib.util.spec_from_file_location("paper_benchmark", REPO / "benchmarks" / "paper.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_regimes_follow_the_scale():
    paper = _paper()
    scale = paper.Scale()  # 640 prompts / 32 per step = a pass of 20 steps
    assert scale.pass_steps == 20
    assert paper.make_regime("stale", scale).interval == 20
    assert (paper.make_regime("lagged", scale).interval, paper.make_regime("lagged", scale).offset) == (1, 10)
    assert paper.make_regime("offline", scale).interval is None
    assert paper.VARIANTS[paper.WIDE] == ("rec-oneside-nois", {"eps_low": 0.6, "eps_high": 2.0})
    # the peers' grid: every peer preset, plus two controls of the default grid
    assert set(paper.PEER_VARIANTS) == {"rec-oneside-nois", "grpo", "cispo", "m2po", "dual-clip", "icepop",
                                        "icepop-seq", "opsm", "sapo", "gmpo", "dapo", "dr-grpo"}
    assert all(paper.VARIANTS[name] == (name, {}) for name in paper.PEER_VARIANTS)


def test_aggregate_worked_by_hand():
    paper = _paper()

    def curve(*values):
        return [{"step": 10 * i, "greedy_accuracy": v, "accuracy": v / 2} for i, v in enumerate(values)]

    results = [
        {
            "variant": "reinforce",
            "regime": "offline",
            "seed": 0,
            "curve": curve(0.4, 0.7, 0.5),
            "train": {},
            "seconds": 60,
        },
        {
            "variant": "reinforce",
            "regime": "offline",
            "seed": 1,
            "curve": curve(0.4, 0.5, 0.5),
            "train": {},
            "seconds": 60,
        },
    ]
    (row,) = paper.aggregate(results, threshold=0.6)
    assert row["final"] == pytest.approx(0.5)  # (0.5 + 0.5) / 2
    assert row["best"] == pytest.approx(0.6)  # (0.7 + 0.5) / 2
    assert row["drop"] == pytest.approx(0.1)  # ((0.7 - 0.5) + (0.5 - 0.5)) / 2
    assert (row["reached"], row["steps_to_threshold"]) == (1, 10)  # only seed 0 reaches 0.6, at step 10
    assert row["final_t1"] == pytest.approx(0.25)
    assert row["minutes"] == pytest.approx(2.0)
    assert row["ess"] is None and "| - |" in paper.markdown_table([row], 0.6)  # runs from before the ess metric
    for result, ess in zip(results, (0.9, 0.7)):
        result["train"]["ess_mean"] = ess
    (row,) = paper.aggregate(results, threshold=0.6)
    assert row["ess"] == pytest.approx(0.8) and paper.markdown_table([row], 0.6).endswith("| 0.800 |\n")


@pytest.mark.slow  # 5-15 s: 6 short trainings, 6 collections, 5 evaluations of a random tiny model
def test_paper_grid_smoke(tmp_path, tiny_policy):
    paper = _paper()
    # 8 prompts / 4 per step: a pass is 2 steps; 4 steps = 2 passes; lag 1 for the lagged regime.
    scale = paper.Scale(prompts_per_step=4, pool=8, steps=4, eval_every=2, eval_prompts=8, batch_size=8, lag=1)
    outcome = paper.run_grid(tmp_path / "paper", ["reinforce"], ["stale", "lagged"], [0], scale,
                             policy=tiny_policy, log=lambda message: None)
    results = [json.loads(line) for line in (tmp_path / "paper" / "results.jsonl").read_text().splitlines()]
    assert [(r["regime"], [p["step"] for p in r["curve"]]) for r in results] == [("stale", [0, 2, 4]),
                                                                                ("lagged", [0, 2, 4])]
    stale, lagged = results
    assert stale["train"]["steps"] == lagged["train"]["steps"] == 4
    # stale (k=2, d=0): data re-collected at steps 0 and 2 from the current policy: ages 0,1,0,1
    assert stale["train"]["staleness_mean"] == pytest.approx(0.5)
    # lagged (k=1, d=1): step t trains on data of the policy after step max(0, t-1): ages 0,1,1,1
    assert lagged["train"]["staleness_mean"] == pytest.approx(0.75)
    assert "| stale | reinforce | 1 |" in outcome["table"]
    assert (tmp_path / "paper" / "curves.png").stat().st_size > 0
    # a rerun finds both runs done and runs nothing
    again = paper.run_grid(tmp_path / "paper", ["reinforce"], ["stale", "lagged"], [0], scale, policy=tiny_policy,
                           log=lambda message: None)
    assert again["results"] == 2
    assert len((tmp_path / "paper" / "results.jsonl").read_text().splitlines()) == 2
    # The restarted segments of a run each began as version 0.
    segment = tmp_path / "paper" / "runs" / "reinforce" / "stale" / "seed0" / "train-00002" / "metrics.jsonl"
    assert [json.loads(line)["trained_policy_version"] for line in segment.read_text().splitlines()] == [0, 1]


@pytest.mark.slow
def test_paper_grid_can_continue_the_optimizer_across_segments(tmp_path, tiny_policy):
    paper = _paper()
    scale = paper.Scale(prompts_per_step=4, pool=8, steps=4, eval_every=2, eval_prompts=8, batch_size=8, lag=1,
                        optimizer="continue")
    paper.run_grid(
        tmp_path / "paper", ["reinforce"], ["stale"], [0], scale, policy=tiny_policy, log=lambda message: None
    )
    segment = tmp_path / "paper" / "runs" / "reinforce" / "stale" / "seed0" / "train-00002" / "metrics.jsonl"
    # The second segment continued the first one's run (init_from): its policy is 2 updates old.
    assert [json.loads(line)["trained_policy_version"] for line in segment.read_text().splitlines()] == [2, 3]
    restart = paper.Scale(**{**paper.asdict(scale), "optimizer": "restart"})
    assert paper.read_results(tmp_path / "paper", restart) == []  # results of one choice never stand for the other
    assert len(paper.read_results(tmp_path / "paper", scale)) == 1


@pytest.mark.slow
def test_logged_demo_collects_one_response_per_prompt_and_trains_with_a_baseline(tmp_path, tiny_policy, capsys):
    from offline_rec.dataset.inspect import describe_dataset
    from offline_rec.demo.pipeline import LOGGED

    out = tmp_path / "logged"
    # 16 prompts answered once (16 groups of one), 8 per step: 2 steps; evaluations still pass@4
    code, output = run_demo_cli(capsys, "demo", "--out", str(out), "--model", tiny_policy, "--quick", "--logged",
                                "--num-prompts", "16", "--epochs", "1", "--eval-prompts", "8", "--select", "final")
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["logged"] is True
    assert summary["algorithm"] == LOGGED["algorithm"]
    assert summary["algorithm_overrides"]["baseline"] == LOGGED["baseline"]
    stats = describe_dataset(out / "data")
    assert stats["group_size_histogram"] == {1: 16}
    assert "pass@4" in summary["after"] and summary["steps"] >= 1
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["singleton_groups"] == m["groups"] and m["grad_norm"] > 0 for m in metrics)
    baseline = json.loads((out / "run" / "baseline.json").read_text())
    assert baseline["baseline"] == LOGGED["baseline"]
    # another preset keeps its own spec: topr's threshold (the data's mean), not the logged recipe's clip
    code, output = run_demo_cli(capsys, "demo", "--out", str(tmp_path / "topr"), "--model", tiny_policy, "--quick",
                                "--logged", "--algorithm", "topr", "--num-prompts", "16", "--epochs", "1",
                                "--eval-prompts", "8", "--select", "final", "--default-clip")
    assert code == 0, output
    baseline = json.loads((tmp_path / "topr" / "run" / "baseline.json").read_text())
    assert (baseline["baseline"], baseline["group_mean"]) == ("dataset", False)
    topr_summary = json.loads((tmp_path / "topr" / "summary.json").read_text())
    assert "eps_low" not in topr_summary["algorithm_overrides"], topr_summary["algorithm_overrides"]


def test_the_default_recipe_trains_steps_of_rows_and_the_others_whole_groups():
    from offline_rec.demo.estimate import step_rows
    from offline_rec.demo.pipeline import LOGGED, OWN_MODEL, DemoSettings

    default = DemoSettings()  # rec-logged: its recipe brings the steps of rows and the skip, the demo adds nothing
    assert default.algorithm == "rec-logged" and default.train_overrides == ()
    assert (default.lr, default.epochs, default.lr_schedule) == (6e-4, 2, "cosine")
    # before collect the skipped rows are unknown: 4096 x 8 / 128 = 256 steps an epoch, x 2 (the run makes ~414)
    assert step_rows(default) == (512, 128)
    # --logged and --model train rec-oneside-nois, whose recipe is whole-group steps: 4096 / 128 x 8 epochs;
    # 32 / 8 x 1 epoch, 8 groups of 4 rows
    assert DemoSettings(**LOGGED).train_overrides == () and step_rows(DemoSettings(**LOGGED)) == (256, 128)
    assert DemoSettings(**OWN_MODEL).train_overrides == () and step_rows(DemoSettings(**OWN_MODEL)) == (4, 32)


def test_a_preset_with_a_regularizer_trains_its_own_recipe(tmp_path):
    # opmd's recipe has whole-group steps and no skip (its regularizer gives rows of advantage 0 a gradient)
    from offline_rec.demo.estimate import step_rows
    from offline_rec.demo.pipeline import DemoSettings
    from offline_rec.training.config import TrainConfig

    assert step_rows(DemoSettings(algorithm="opmd")) == (256, 32 * 8)
    config = TrainConfig(data=["d"], model=str(tmp_path), algorithm="opmd", out="r")
    assert (config.batching, config.skip_zero_advantage) == ("groups", False)


@pytest.mark.slow  # a demo of 64 prompts (~4 steps of 128 rows) and the same training through the CLI
def test_train_with_the_demos_preset_on_its_data_reproduces_its_training(tmp_path, tiny_policy, capsys):
    """`offline-rec train --algorithm rec-logged` on the demo's own data trains what the demo trained: the same steps,
    rows and loss curve (the demo trains the preset's whole recipe: rows shuffled across prompts, the skip, its
    measured lr, schedule and epochs)."""
    from offline_rec.demo.pipeline import run_demo

    summary = run_demo(tmp_path / "demo", model=tiny_policy, progress=False, num_prompts=64, num_samples=4,
                       eval_prompts=8, validation_prompts=8, batch_size=64)
    capsys.readouterr()
    code, out, err = run_cli(capsys, "train", "--data", summary["paths"]["dataset"], "--model", tiny_policy,
                             "--algorithm", "rec-logged", "--out", tmp_path / "train", "--set", "progress=false",
                             "--set", "report_to=[]")
    assert code == 0, err
    # the recipe first, nothing moved away from it
    assert out.startswith("recipe rec-logged: clip one-side-negatives") and " moves " not in out

    def curve(run):
        lines = [json.loads(line) for line in (Path(run) / "metrics.jsonl").read_text().splitlines()]
        return [(m["step"], m["rows"], m["num_tokens"], m["loss"], m["lr"]) for m in lines]

    demo, cli = curve(summary["paths"]["run"]), curve(tmp_path / "train")
    assert len(demo) >= 3 and max(rows for _, rows, *_ in demo) == 128  # steps of 128 rows (an epoch's last: the rest)
    assert cli == demo
