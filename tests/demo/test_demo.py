"""`offline-rec demo`, end to end at toy sizes, and its settings.

The behavior policy is the shipped demo policy (0.8M parameters, about half of its greedy answers
right), so the toy datasets hold both rewards: `train` refuses data without any learning signal.
These tests check that every stage runs and leaves the outputs it promises, not that learning
happens at these sizes (docs/paper.md and the demo's own run report that).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
from support.cli_support import run_cli

from offline_rec.demo.config import DemoSettings
from offline_rec.errors import UserError

# 8 train prompts x 4 samples, 1 epoch of the demo's steps of rows, 8 rows a step: ceil(rows of nonzero
# advantage / 8) optimizer steps (`nonzero_advantage_rows`), one checkpoint at the end (eval_every 52 > steps).
TOY_ROWS_PER_STEP = 8
TOY = DemoSettings(num_prompts=8, num_samples=4, epochs=1, eval_prompts=8, validation_prompts=8, batch_size=8,
                   train_changes=(("rows_per_step", TOY_ROWS_PER_STEP),))


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
    summary = run_demo(out, TOY, model=tiny_policy, progress=False)
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
    assert len(validation) == TOY.validation_prompts == len({item.prompt for item in validation})
    assert all(arith_split(item.fields["a"], item.fields["b"]) == "train" for item in validation)  # not test
    assert all(item.prompt == f"What is {item.fields['a']}+{item.fields['b']}? " for item in validation)
    trained = set(open_dataset(summary["paths"]["dataset"]).to_table(columns=["prompt"]).column("prompt").to_pylist())
    assert len(trained) == TOY.num_prompts
    assert not trained & {item.prompt for item in validation}
    # every point of the curve, step 0 (the behavior policy) included, has a validation evaluation on disk
    for point in summary["curve"]:
        folder = out / "run" / "eval-validation" / f"step-{point['step']:06d}"
        written = json.loads((folder / "summary.json").read_text())
        assert written["metrics"]["greedy_accuracy"] == point["validation_greedy_accuracy"]
        assert written["metrics"]["num_prompts"] == TOY.validation_prompts


@pytest.mark.slow
def test_an_existing_output_is_refused_unless_it_is_a_demo_and_overwrite_is_given(demo, tmp_path, tiny_policy):
    from offline_rec.demo.pipeline import run_demo

    out, _ = demo
    with pytest.raises(UserError, match="already exists"):
        run_demo(out, TOY, model=tiny_policy, progress=False)
    foreign = tmp_path / "mine"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("keep me")
    with pytest.raises(UserError, match="not a folder an earlier demo wrote"):
        run_demo(foreign, TOY, model=tiny_policy, overwrite=True, progress=False)
    assert (foreign / "notes.txt").read_text() == "keep me"


def test_bad_settings_fail_before_anything_is_written(tmp_path):
    from offline_rec.demo.pipeline import run_demo

    for bad, message in ((dict(epochs=0), "epochs"), (dict(num_samples=1), "num-samples"), (dict(backend="tpu"), "tpu"),
                         (dict(algorithm="ppo"), "ppo"), (dict(select="best-test"), "select must be one of"),
                         (dict(validation_prompts=0), "needs validation prompts"),
                         (dict(validation_prompts=-1, select="final"), "validation-prompts must be >= 0"),
                         (dict(num_prompts=6500, validation_prompts=51),
                          r"\(6500 \+ 51\) do not fit the arith train split: .* has 6550"),
                         (dict(task="add7"), "add7"),
                         (dict(train_changes=(("lr_schedule", "linear"),)), "lr_schedule"),
                         (dict(train_changes=(("lr_shedule", "cosine"),)), "did you mean 'lr_schedule'"),
                         (dict(recipe="no-such.yaml"), "no-such.yaml does not exist")):
        with pytest.raises(UserError, match=message):
            run_demo(tmp_path / "out", replace(DemoSettings(), **bad), model="unused", progress=False)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow  # a toy demo on add3 (~20 s)
def test_demo_on_add3_runs_its_shipped_policy_and_reports_the_ood_split(tmp_path):
    from offline_rec import schema as S
    from offline_rec.dataset.format import open_dataset
    from offline_rec.demo.behavior_policy import demo_policy_path
    from offline_rec.demo.config import demo_settings
    from offline_rec.demo.pipeline import run_demo
    from offline_rec.tasks.builtin import add_split
    from offline_rec.tasks.prompts import load_prompts

    settings = replace(demo_settings(task="add3"), **{name: getattr(TOY, name) for name in (
        "num_prompts", "num_samples", "epochs", "eval_prompts", "validation_prompts", "batch_size", "train_changes")})
    assert (settings.task, settings.chat_template, settings.max_new_tokens) == ("add3", False, 8)
    summary = run_demo(tmp_path / "out", settings, progress=False)
    assert summary["paths"]["policy"] == demo_policy_path("add3")
    dataset = open_dataset(summary["paths"]["dataset"])
    assert dataset.task["name"] == "add3"
    rows = dataset.to_table(columns=[S.PROMPT, S.META]).to_pylist()
    assert all(add_split(json.loads(row[S.META])["a"], json.loads(row[S.META])["b"], 3) == "train" for row in rows)
    validation = load_prompts(summary["paths"]["validation_prompts"])
    assert len(validation) == TOY.validation_prompts
    assert all(add_split(item.fields["a"], item.fields["b"], 3) == "train" for item in validation)
    assert not {row[S.PROMPT] for row in rows} & {item.prompt for item in validation}
    # the ood split (every column carries), before and after, evaluated like the test split
    assert set(summary["ood"]) == {"before", "after"}
    ood = json.loads((Path(summary["paths"]["after_ood"]) / "summary.json").read_text())
    assert ood["metrics"]["num_prompts"] == TOY.eval_prompts
    assert summary["ood"]["after"]["greedy_accuracy"] == ood["metrics"]["greedy_accuracy"]


def test_the_validation_prompts_of_arith_are_the_draw_after_the_trained_ones():
    """write_validation_prompts reads no task's internals: for arith it gives what the demo always gave (the seeded
    shuffle of the train split with the trained prompts left out), so no measured demo moves."""
    from offline_rec.tasks.builtin import arith_pairs, arith_prompts, get_prompts, get_task

    trained = {item.id for item in arith_prompts(4096, seed=3)}
    before = [item.id for item in arith_prompts(len(arith_pairs("train")), seed=3) if item.id not in trained][:512]
    after = [item.id for item in get_prompts(get_task("arith"), n=4096 + 512, seed=3) if item.id not in trained]
    assert after == before


def test_a_missing_demo_policy_is_built_once_into_the_cache(tmp_path, monkeypatch):
    import offline_rec.demo.behavior_policy as demo_policy
    from offline_rec.demo.inputs import demo_policy_cache, ensure_demo_policy

    def missing(task="arith"):
        raise UserError(f"the {task} demo policy is missing")

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


@pytest.mark.slow
def test_logged_demo_collects_one_response_per_prompt_and_trains_with_a_baseline(tmp_path, tiny_policy, capsys):
    from offline_rec.dataset.inspect import describe_dataset
    from offline_rec.demo.config import demo_settings, objective_changes, training_recipe

    logged = training_recipe(demo_settings(logged=True))
    out = tmp_path / "logged"
    # 16 prompts answered once (16 groups of one), 8 per step: 2 steps; evaluations still pass@4
    code, output = run_demo_cli(capsys, "demo", "--out", str(out), "--model", tiny_policy, "--quick", "--logged",
                                "--num-prompts", "16", "--epochs", "1", "--eval-prompts", "8", "--select", "final")
    assert code == 0, output
    summary = json.loads((out / "summary.json").read_text())
    assert summary["settings"]["logged"] is True
    assert summary["algorithm"] == logged["algorithm"] == "rec-oneside-nois"
    assert summary["algorithm_overrides"] == objective_changes(logged) == {"baseline": "dataset", "eps_high": 2.0}
    stats = describe_dataset(out / "data")
    assert stats["group_size_histogram"] == {1: 16}
    assert "pass@4" in summary["after"] and summary["steps"] >= 1
    metrics = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines()]
    assert all(m["singleton_groups"] == m["groups"] and m["grad_norm"] > 0 for m in metrics)
    baseline = json.loads((out / "run" / "baseline.json").read_text())
    assert baseline["baseline"] == logged["baseline"] == "dataset"
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
    from offline_rec.demo.config import OWN_MODEL, demo_settings, train_config, training_recipe
    from offline_rec.demo.estimate import step_rows

    def train(settings):
        return train_config(training_recipe(settings), settings, "policy", "data", Path("run"), False)

    default = train(DemoSettings())  # rec-logged's whole recipe: its steps of rows and the skip come with the preset
    assert (default.algorithm, default.clip, default.eps_low, default.negative_weight) == (
        "rec-logged", "one-side-negatives", 0.6, 0.25)
    assert (default.batching, default.skip_zero_advantage, default.rows_per_step) == ("rows", True, 128)
    assert (default.lr, default.epochs, default.lr_schedule, default.min_lr_ratio) == (6e-4, 2, "cosine", 0.0)
    assert (default.weight_decay, default.max_grad_norm, default.save_every, default.keep_last) == (0.0, 1.0, 52, 0)
    assert not any(" moves " in line for line in default.recipe_lines())  # the file writes out the preset's recipe
    # before collect the skipped rows are unknown: 4096 x 8 / 128 = 256 steps an epoch, x 2 (the run makes fewer)
    assert step_rows(DemoSettings(), default) == (512, 128)
    # --logged and --model train rec-oneside-nois, whose recipe is whole-group steps: 4096 / 128 x 8 epochs;
    # 32 / 8 x 1 epoch, 8 groups of 4 rows
    logged = demo_settings(logged=True)
    assert train(logged).batching == "groups" and step_rows(logged, train(logged)) == (256, 128)
    own = DemoSettings(**OWN_MODEL)
    assert train(own).batching == "groups" and step_rows(own, train(own)) == (4, 32)
    assert (train(own).lr, train(own).eps_low, train(own).eps_high) == (1e-5, 0.6, 2.0)
    # the user's epochs and wide clip go over the recipe's; --default-clip leaves the preset's own clip
    assert train(DemoSettings(epochs=3, wide_clip=True)).epochs == 3
    assert (train(DemoSettings(wide_clip=True)).eps_low, train(DemoSettings(wide_clip=True)).eps_high) == (0.6, 2.0)
    assert (train(replace(own, wide_clip=False)).eps_low, train(replace(own, wide_clip=False)).eps_high) == (0.2, 0.2)


def test_another_preset_takes_its_own_recipe_and_the_recipe_files_optimizer_settings():
    from offline_rec.demo.config import algorithm_label, demo_settings, training_recipe
    from offline_rec.loss.presets import preset_keys

    logged = training_recipe(demo_settings(logged=True))
    topr = training_recipe(demo_settings(logged=True, algorithm="topr"))
    # the logged recipe's baseline and clip were chosen for rec-oneside-nois: topr keeps its own objective and steps
    assert topr["algorithm"] == "topr" and not set(topr) & preset_keys()
    assert {k: v for k, v in topr.items() if k != "algorithm"} == {
        k: v for k, v in logged.items() if k not in preset_keys() | {"algorithm"}}
    assert algorithm_label(logged) == "rec-oneside-nois, baseline dataset, eps_high 2.0"
    assert algorithm_label(training_recipe(demo_settings(wide_clip=True))) == "rec-logged (wide clip 0.6/2.0)"
    # the recipe's own preset named again changes nothing
    assert training_recipe(demo_settings(logged=True, algorithm="rec-oneside-nois")) == logged


def test_a_preset_with_a_regularizer_trains_its_own_recipe():
    # opmd's recipe has whole-group steps and no skip (its regularizer gives rows of advantage 0 a gradient); the
    # demo's optimizer settings stay
    from offline_rec.demo.config import train_config, training_recipe

    settings = DemoSettings(algorithm="opmd")
    config = train_config(training_recipe(settings), settings, "policy", "data", Path("run"), False)
    assert (config.algorithm, config.batching, config.skip_zero_advantage) == ("opmd", "groups", False)
    assert (config.lr, config.lr_schedule, config.epochs) == (6e-4, "cosine", 2)


def test_the_variants_replace_fields_in_a_fixed_order(tmp_path):
    """--quick, --logged and the user's options each replace the fields they name; --model --quick --logged
    trains the logged recipe as it is (the quick --model steps of 4 groups belong to the --model recipe)."""
    from offline_rec.demo.config import LOGGED, OWN_MODEL, OWN_MODEL_QUICK, QUICK, demo_settings

    assert demo_settings() == DemoSettings()
    assert demo_settings(quick=True) == DemoSettings(**QUICK)
    assert demo_settings(quick=True, logged=True, seed=3, epochs=None) == DemoSettings(**{**QUICK, **LOGGED, "seed": 3})
    from offline_rec.models.tiny import build_chat_tokenizer

    build_chat_tokenizer(vocab_size=300).save_pretrained(tmp_path / "chat")
    (tmp_path / "chat" / "config.json").write_text("{}")  # a model folder; only its tokenizer is read
    own = demo_settings(str(tmp_path / "chat"), quick=True)
    assert own == DemoSettings(**{**OWN_MODEL, **OWN_MODEL_QUICK, "chat_template": True,
                                  "reward": "offline_rec.tasks.builtin:arith_answer_reward"})
    logged = demo_settings(str(tmp_path / "chat"), quick=True, logged=True)
    assert (logged.recipe, logged.train_changes, logged.num_prompts, logged.max_new_tokens) == (
        "logged.yaml", (), 8, 24)


@pytest.mark.slow  # a demo of 64 prompts (~4 steps of 128 rows) and the same training through the CLI
def test_train_with_the_demos_preset_on_its_data_reproduces_its_training(tmp_path, tiny_policy, capsys):
    """`offline-rec train --algorithm rec-logged` on the demo's own data trains what the demo trained: the same steps,
    rows and loss curve (the demo trains the preset's whole recipe: rows shuffled across prompts, the skip, its
    measured lr, schedule and epochs)."""
    from offline_rec.demo.pipeline import run_demo

    settings = DemoSettings(num_prompts=64, num_samples=4, eval_prompts=8, validation_prompts=8, batch_size=64)
    summary = run_demo(tmp_path / "demo", settings, model=tiny_policy, progress=False)
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
