"""report_to: mlflow, trackio and wandb, each with its real library writing to a local store.

One 2-step `offline-rec train`, cut short and resumed, reports to all three at once (mlflow: the default
sqlite store in the run folder; trackio: $TRACKIO_DIR; wandb: offline mode); each store is read back and
must hold, in one run, every number of metrics.jsonl at its step under the namespaced key (`losses/loss`,
...) TensorBoard gets, and the resolved configuration (config.yaml) as the run's config (mlflow: params).
A tracker whose package is missing is refused before anything runs, naming the extra that installs it.
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import subprocess
import sys

import pytest
import yaml
from support.cli_support import run_cli
from support.paths import REPO, TESTS
from support.train_support import config, tiny_model, write_dataset

from offline_rec.training import checkpoint as ckpt
from offline_rec.training.metrics import _NAMESPACE_OF

TRACKERS = ("mlflow", "trackio", "wandb")
STEPS = 2


def _namespaced(key: str) -> str:
    return f"{_NAMESPACE_OF.get(key, 'train')}/{key}"


@pytest.fixture(scope="module")
def tracked_run(tmp_path_factory):
    """The run folder, its metrics.jsonl lines and config.yaml, and the trackio folder.

    The run is cut short after step 2's metrics line, before its checkpoint (its last checkpoint and final/
    removed, as a crash leaves them), then resumed: step 2 runs again into the same tracker runs."""
    for name in TRACKERS:
        pytest.importorskip(name)
    root = tmp_path_factory.mktemp("trackers")
    model = tiny_model(root / "model")
    data = write_dataset(root / "data", model, num_groups=8)
    run = root / "run"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), str(REPO), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline", "WANDB_SILENT": "true",
           "TRACKIO_DIR": str(root / "trackio")}
    for inherited in ("MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "MLFLOW_RUN_ID"):
        env.pop(inherited, None)

    def train(*argv):
        result = subprocess.run([sys.executable, "-m", "offline_rec", "train", "--out", str(run), *map(str, argv)],
                                env=env, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]

    train("--data", data, "--model", model, "--algorithm", "rec-oneside-is", "--max-steps", STEPS,
          "--set", "prompts_per_step=4", "--set", "micro_batch_tokens=64", "--set", "progress=false",
          "--set", "cpu=true", "--set", "save_every=1", "--set", f"report_to=[{','.join(TRACKERS)}]")
    first = _metrics_lines(run)
    shutil.rmtree(run / ckpt.FINAL_DIR)
    shutil.rmtree(ckpt.latest_checkpoint(run))
    train("--resume")
    lines = _metrics_lines(run)
    timing = ("seconds", "tokens_per_s")
    assert [{k: v for k, v in line.items() if k not in timing} for line in lines] == [
        {k: v for k, v in line.items() if k not in timing} for line in first]  # resumed bit for bit
    assert [line["step"] for line in lines] == list(range(1, STEPS + 1))
    resolved = yaml.safe_load((run / "config.yaml").read_text())
    return {"run": run, "lines": lines, "config": resolved, "trackio": root / "trackio"}


def _metrics_lines(run) -> list[dict]:
    return [json.loads(line) for line in (run / ckpt.METRICS_FILE).read_text().splitlines()]


def _assert_all_metrics(lines: list[dict], logged: dict[int, dict]) -> None:
    """`logged`: step -> {key: value} as a tracker stored them, the resumed run's values last."""
    assert sorted(logged) == [line["step"] for line in lines]
    for line in lines:
        numbers = {_namespaced(k): v for k, v in line.items() if k != "step" and isinstance(v, (int, float))}
        assert len(numbers) > 20
        got = {key: logged[line["step"]].get(key) for key in numbers}
        assert got == pytest.approx(numbers, rel=1e-6), line["step"]


@pytest.mark.slow  # the module's run: two train processes, ~1 min on 2 cores
def test_mlflow_run_holds_the_metrics_and_the_config_as_params(tracked_run):
    from mlflow.tracking import MlflowClient

    run = tracked_run["run"]
    client = MlflowClient(tracking_uri=f"sqlite:///{run / 'mlflow.db'}")
    (found,) = client.search_runs([client.get_experiment_by_name("offline-rec").experiment_id])
    assert found.data.tags["offline_rec.run_dir"] == str(run.resolve())
    logged: dict[int, dict] = {}
    for key in found.data.metrics:
        for point in sorted(client.get_metric_history(found.info.run_id, key), key=lambda point: point.timestamp):
            logged.setdefault(point.step, {})[key] = point.value
    _assert_all_metrics(tracked_run["lines"], logged)
    # mlflow keeps params as text, str() of each resolved value, and refuses to change one: the first
    # process's values stay (resume was false then)
    first = {**tracked_run["config"], "resume": False}
    assert tracked_run["config"]["resume"] is True
    assert found.data.params == {key: str(value) for key, value in first.items()}


@pytest.mark.slow
def test_trackio_run_holds_the_metrics_and_the_config(tracked_run):
    code = (
        "import json, sys\n"
        "from trackio.sqlite_storage import SQLiteStorage as S\n"
        "(run,) = S.get_runs('offline-rec')\n"
        "print(json.dumps({'run': run, 'logs': S.get_logs('offline-rec', run),"
        " 'config': S.get_run_config('offline-rec', run)}, default=str))\n"
    )
    # trackio reads TRACKIO_DIR when imported: a fresh interpreter reads the run's store
    env = {**os.environ, "TRACKIO_DIR": str(tracked_run["trackio"])}
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120,
                            check=True)
    stored = json.loads(result.stdout.splitlines()[-1])
    assert stored["run"].startswith("run-")
    _assert_all_metrics(tracked_run["lines"], {entry["step"]: entry for entry in stored["logs"]})
    own = {key: value for key, value in stored["config"].items() if not key.startswith("_")}  # _: trackio's own
    assert own == tracked_run["config"]


def _wandb_records(path):
    """The protobuf records of a .wandb file: a 7-byte header (":W&B", magic, version), then LevelDB-log
    chunks (crc32, length, type: 1 full, 2 first, 3 middle, 4 last) in 32 KiB blocks."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    assert data[:4] == b":W&B"
    position, pending = 7, b""
    while position + 7 <= len(data):
        left = 32768 - position % 32768
        if left < 7:  # a block's tail too short for a chunk header is padding
            position += left
            continue
        length, kind = struct.unpack("<HB", data[position + 4:position + 7])
        chunk = data[position + 7:position + 7 + length]
        position += 7 + length
        pending = chunk if kind in (1, 2) else pending + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pending)
            yield record


@pytest.mark.slow
def test_wandb_offline_run_holds_the_metrics_and_the_config(tracked_run):
    paths = sorted((tracked_run["run"] / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(paths) == 2 and len({path.name for path in paths}) == 1  # the resumed process continued the run id
    logged, run_config = {}, {}
    for record in (record for path in paths for record in _wandb_records(path)):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            items = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
            logged[items.pop("_step")] = items
        elif kind == "run":
            run_config.update({item.key: json.loads(item.value_json) for item in record.run.config.update})
    _assert_all_metrics(tracked_run["lines"], logged)
    assert {key: value for key, value in run_config.items() if not key.startswith("_")} == tracked_run["config"]


@pytest.mark.parametrize("name", TRACKERS)
def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, capsys, monkeypatch, name):
    monkeypatch.setitem(sys.modules, name, None)  # find_spec(name) is None and `import name` fails: not installed
    code, out, err = run_cli(capsys, "train", "--data", str(tmp_path / "d"), "--model", str(tmp_path / "m"),
                             "--algorithm", "grpo", "--out", str(tmp_path / "run"), "--set", f"report_to=[{name}]")
    assert code == 2
    assert err.strip() == f'error: report_to: {name} needs {name}: pip install "offline-rec[{name}]"'
    assert not (tmp_path / "run").exists()


@pytest.mark.slow  # two mlflow sqlite stores created: ~10 s each
def test_mlflow_store_is_the_option_else_the_environment(tmp_path, monkeypatch):
    pytest.importorskip("mlflow")
    from mlflow.tracking import MlflowClient

    from offline_rec.training.metrics import MetricsLog

    option, environment = (f"sqlite:///{tmp_path / name}" for name in ("option.db", "environment.db"))
    monkeypatch.setenv("MLFLOW_TRACKING_URI", environment)
    for name, uri in (("first", option), ("second", None)):
        run = tmp_path / name
        run.mkdir()
        log = MetricsLog(run, config(tmp_path, "model", "data", out=str(run), report_to=["mlflow"],
                                     mlflow_tracking_uri=uri), start_step=0, active=True)
        log.write({"step": 1, "loss": 0.25, "lr": 1e-3})
        log.close()
        assert not (run / "mlflow.db").exists()
    # the first run's explicit store did not become the second's (mlflow.set_tracking_uri also sets the variable)
    for uri, name, param in ((option, "first", option), (environment, "second", "None")):
        client = MlflowClient(tracking_uri=uri)
        (found,) = client.search_runs([client.get_experiment_by_name("offline-rec").experiment_id])
        assert found.info.run_name == name
        assert found.data.metrics == {"losses/loss": 0.25, "charts/lr": 1e-3}
        assert found.data.params["mlflow_tracking_uri"] == param
    assert os.environ["MLFLOW_TRACKING_URI"] == environment
