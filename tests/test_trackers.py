"""TensorBoard, W&B (offline) and MLflow (local file store) receive exactly the scalars of metrics.jsonl.

One short `exactrl sft` and one `exactrl rl` run, each with all three trackers on, are read back
with each tracker's own reader and compared, key by key and (step, value) by (step, value), with
a series built here from metrics.jsonl; the config and the manifest must have arrived too. The
runs cannot reach a network: W&B is offline, MLflow writes to a file:// store, and any HTTP(S)
request goes to a proxy that does not exist (a tracker that tried to connect would fail the run).
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import threading
import time
import warnings
from collections import defaultdict
from functools import partial
from pathlib import Path

import numpy as np
import pytest
import yaml

from exactrl.algorithms.sft import train_sft
from exactrl.config import SFTConfig, load_config
from exactrl.config.loader import ConfigError
from exactrl.tasks.builtin import BuiltinSpec

SMALL = ["train.global_batch_size=8", "train.micro_batch_size=4", "train.log_every=1", "data.eval_size=4"]
RUNS = {
    # eval at step 2 and at the end: eval_accuracy is a scalar, eval_ci95 a list trackers skip.
    "sft": ["train.max_steps=3", "train.eval_every=2", "log.wandb.mode=offline"],
    # kl_coef > 0 adds the reference model's rollout_kl; ratio_dev_first is None after the first update.
    # No log.wandb.mode or name: W&B's own WANDB_MODE=offline and WANDB_NAME (set for this run) decide.
    "rl": ["train.max_steps=4", "algo.group_size=4", "algo.mini_batches=2", "algo.kl_coef=0.05",
           "rollout.max_new_tokens=8", "reward.fn=reward_fixtures:varied"],
}
ENV = {"sft": {}, "rl": {"WANDB_NAME": "named-by-wandb-name"}}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """{command: (run directory, MLflow URI, stdout + stderr)} of one finished run per command, all trackers on."""
    root = tmp_path_factory.mktemp("trackers")
    env = {**os.environ, "EXACTRL_CACHE": str(root / "cache"), "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline",
           "WANDB_DIR": str(root / "wandb"), "WANDB_CONFIG_DIR": str(root / "wandb-config"),
           "WANDB_CACHE_DIR": str(root / "wandb-cache"), "WANDB_DATA_DIR": str(root / "wandb-data"),
           "HTTP_PROXY": "http://127.0.0.1:9", "HTTPS_PROXY": "http://127.0.0.1:9", "NO_PROXY": "127.0.0.1,localhost",
           "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")])}
    env.pop("WANDB_API_KEY", None)
    env.pop("DS_ACCELERATOR", None)  # as a user's shell has it (a DeepSpeed test in this process may have set it)
    out = {}
    for command, overrides in RUNS.items():
        run, uri = root / command, f"file://{root / 'mlruns'}"
        args = [*SMALL, *overrides, f"output_dir={run}", "log.tensorboard=true", "log.wandb.project=exactrl-test",
                f"log.mlflow.uri={uri}", f"log.mlflow.experiment={command}"]
        proc = subprocess.run([sys.executable, "-m", "exactrl.cli", command, *args], env=env | ENV[command], cwd=root,
                              stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600)
        assert proc.returncode == 0, f"exactrl {command} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        out[command] = run, uri, proc.stdout + proc.stderr
    return out


def jsonl_series(run: Path) -> dict[str, list[tuple[int, float]]]:
    """The reference: every int/float/bool value of metrics.jsonl as <phase>/<key> at the record's step."""
    series = defaultdict(list)
    for record in map(json.loads, (run / "metrics.jsonl").read_text().splitlines()):
        for key, value in record.items():
            if key not in ("phase", "step", "time") and type(value) in (int, float, bool):
                series[f"{record['phase']}/{key}"].append((record["step"], float(value)))
    return dict(series)


def assert_same_series(got: dict, run: Path, rounding=float) -> None:
    """``rounding``: what the tracker's format keeps of a float64 (TensorBoard's scalar field is a float32)."""
    want = jsonl_series(run)
    assert sorted(got) == sorted(want)
    for key in want:
        assert sorted(got[key]) == sorted((step, rounding(value)) for step, value in want[key]), key


def read_tensorboard(run: Path) -> tuple[dict, dict]:
    """Scalars the way TensorBoard's scalar views and scripts read them (EventAccumulator.Scalars), texts as tensors."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, TENSORS, EventAccumulator
    from tensorboard.util import tensor_util

    acc = EventAccumulator(str(run / "tensorboard"), size_guidance={SCALARS: 0, TENSORS: 0})  # 0: keep every event
    acc.Reload()
    series = {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}
    texts = {}
    for tag in acc.Tags()["tensors"]:
        if acc.SummaryMetadata(tag).plugin_data.plugin_name != "text":
            continue  # values written as tensors, which Scalars does not see: assert_same_series says they are missing
        # add_text: the last one sent (at the end of the run)
        text = tensor_util.make_ndarray(acc.Tensors(tag)[-1].tensor_proto).item().decode()
        texts[tag.removesuffix("/text_summary")] = [line[4:] for line in text.splitlines()]
    return series, texts


def read_wandb(run: Path) -> tuple[dict, dict, Path, str]:
    """W&B's own reader of the offline run's transaction log (`wandb leet inspect --json`)."""
    (offline,) = (run / "wandb").glob("offline-run-*")
    wandb_cli = Path(sys.executable).with_name("wandb")
    proc = subprocess.run([str(wandb_cli), "leet", "inspect", "--json", str(offline)], capture_output=True, text=True,
                          timeout=120, stdin=subprocess.DEVNULL, check=True)
    series, config, name = defaultdict(list), {}, None
    for record in map(json.loads, filter(None, proc.stdout.splitlines())):
        if record.get("type") == "history":
            item = record["history"]["item"]
            for key, value in item.items():
                if not key.startswith("_"):  # W&B's own _step, _runtime, _timestamp
                    series[key].append((item["_step"], float(value)))
        elif record.get("type") == "run":
            config = {k: v for k, v in record["run"]["config"]["update"].items() if k != "_wandb"}
            name = record["run"]["display_name"]
    return dict(series), config, offline / "files", name


def read_mlflow(uri: str, experiment: str, tmp_path: Path):
    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    (run,) = client.search_runs([client.get_experiment_by_name(experiment).experiment_id])
    series = {k: [(m.step, m.value) for m in client.get_metric_history(run.info.run_id, k)] for k in run.data.metrics}
    files = {name: Path(client.download_artifacts(run.info.run_id, name, str(tmp_path))).read_text()
             for name in ("config.yaml", "manifest.json")}
    return series, run.data.params, files, run.info.status


def flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in node.items():
        out.update(flat(v, f"{prefix}{k}.") if isinstance(v, dict) else {f"{prefix}{k}": v})
    return out


@pytest.mark.parametrize("command", RUNS)
def test_tensorboard_holds_the_scalars_of_metrics_jsonl(runs, command):
    run, *_ = runs[command]
    series, texts = read_tensorboard(run)
    assert_same_series(series, run, rounding=lambda v: float(np.float32(v)))
    assert texts == {name: (run / name).read_text().splitlines() for name in ("config.yaml", "manifest.json")}


@pytest.mark.parametrize("command", RUNS)
def test_wandb_offline_run_holds_the_scalars_of_metrics_jsonl(runs, command):
    run, *_ = runs[command]
    series, config, files, name = read_wandb(run)  # an offline run: log.wandb.mode=offline, or WANDB_MODE alone (rl)
    assert name == ENV[command].get("WANDB_NAME", f"{run.name}-{command}")
    assert_same_series(series, run)
    assert config == flat(yaml.safe_load((run / "config.yaml").read_text()))
    for name in ("config.yaml", "manifest.json"):
        assert (files / name).read_text() == (run / name).read_text(), name


@pytest.mark.parametrize("command", RUNS)
def test_mlflow_file_store_holds_the_scalars_of_metrics_jsonl(runs, command, tmp_path):
    run, uri, _ = runs[command]
    series, params, files, status = read_mlflow(uri, command, tmp_path)
    assert_same_series(series, run)
    config = flat(yaml.safe_load((run / "config.yaml").read_text()))
    assert params == {k: v if isinstance(v, str) else json.dumps(v) for k, v in config.items()}
    assert files == {name: (run / name).read_text() for name in ("config.yaml", "manifest.json")}
    assert status == "FINISHED"


@pytest.mark.parametrize("command", RUNS)
def test_a_cpu_run_prints_no_deepspeed_accelerator_probe(runs, command):
    """accelerate imports DeepSpeed in save_pretrained whatever the backend; its probe must not speak."""
    *_, output = runs[command]
    assert "Setting accelerator to CPU" not in output


@pytest.mark.parametrize("key, module", [("log.tensorboard=true", "tensorboard"), ("log.wandb.project=p", "wandb"),
                                         ("log.mlflow.uri=file:///nowhere", "mlflow")])
def test_a_missing_tracker_package_is_a_one_line_error_before_the_run(tmp_path, monkeypatch, key, module):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    monkeypatch.setitem(sys.modules, module, None)  # `import module` now raises ImportError
    cfg = load_config(SFTConfig, None, ["data.eval=null", "train.max_steps=1", "train.global_batch_size=8",
                                        "train.micro_batch_size=4", key, f"output_dir={tmp_path / 'run'}"])
    name = key.split("=")[0]
    expected = rf"^{name} needs the '{module}' package.*pip install 'exactrl\[{module}\]'"
    with pytest.raises(ConfigError, match=expected) as e:
        train_sft(cfg, spec=BuiltinSpec(n_sft=64, n_rl=8, n_eval=8))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run").exists()  # nothing was created


def test_a_tracker_that_cannot_start_is_a_one_line_error(tmp_path, monkeypatch):
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    cfg = load_config(SFTConfig, None, ["data.eval=null", "train.max_steps=1", "train.global_batch_size=8",
                                        "train.micro_batch_size=4", "log.mlflow.uri=nosuchscheme://x",
                                        f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(ConfigError, match=r"^log.mlflow.uri: the tracker could not start \(.*nosuchscheme") as e:
        train_sft(cfg, spec=BuiltinSpec(n_sft=64, n_rl=8, n_eval=8))
    assert "\n" not in str(e.value)
    assert not (tmp_path / "run" / "final").exists()


@pytest.mark.parametrize("command, overrides, key, fmt", [
    ("sft", ["data.eval=null", "train.max_steps=3"], "loss", "{:.4f}"),
    ("rl", ["data.eval=null", "train.max_steps=2", "algo.group_size=4", "rollout.max_new_tokens=8",
            "reward.fn=reward_fixtures:varied"], "reward_mean", "{:.3f}"),
])
def test_each_progress_line_off_a_terminal_carries_its_own_steps_figures(tmp_path, monkeypatch, command, overrides,
                                                                         key, fmt):
    from typer.testing import CliRunner

    import exactrl.progress
    from exactrl.cli import app

    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    # A line per step (the period is normally 30 s), so every step's line is compared, not only the last.
    monkeypatch.setattr(exactrl.progress, "PlainProgress", partial(exactrl.progress.PlainProgress, every_s=0))
    run = tmp_path / "run"
    result = CliRunner().invoke(app, [command, *SMALL, *overrides, f"output_dir={run}"])  # stderr: not a terminal
    assert result.exit_code == 0, result.output
    shown = dict(re.findall(rf"^{command}: step (\d+)/\d+ .*, \w+=(\S+)$", result.output, re.MULTILINE))
    want = {str(r["step"]): fmt.format(r[key]) for r in map(json.loads,
                                                            (run / "metrics.jsonl").read_text().splitlines())
            if key in r}
    assert len(want) == int(overrides[1].split("=")[1]) and shown == want


@pytest.mark.parametrize("key, switch", [("log.wandb.mode=offline", "log.wandb.project"),
                                         ("log.wandb.entity=team", "log.wandb.project"),
                                         ("log.wandb.name=n", "log.wandb.project"),
                                         ("log.mlflow.experiment=e", "log.mlflow.uri")])
def test_a_tracker_setting_without_the_tracker_is_refused(key, switch):
    with pytest.raises(ConfigError, match=rf"{re.escape(key)} has no effect: .* \({switch} unset\); set {switch}") as e:
        load_config(SFTConfig, None, [key])
    assert "\n" not in str(e.value)


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_an_mlflow_server_that_does_not_answer_is_one_line_in_seconds(tmp_path, monkeypatch, capsys):
    """MLflow's client retries for about 270 s before it says anything; the run must say what it tries and stop."""
    monkeypatch.setenv("EXACTRL_CACHE", str(tmp_path / "cache"))
    uri = f"http://127.0.0.1:{closed_port()}"
    cfg = load_config(SFTConfig, None, ["data.eval=null", "train.max_steps=1", "train.global_batch_size=8",
                                        "train.micro_batch_size=4", f"log.mlflow.uri={uri}",
                                        f"output_dir={tmp_path / 'run'}"])
    t0 = time.monotonic()
    with pytest.raises(ConfigError, match=rf"^log.mlflow.uri={uri}: {uri}/api/\S+ could not be reached \(") as e:
        train_sft(cfg, spec=BuiltinSpec(n_sft=64, n_rl=8, n_eval=8))
    assert time.monotonic() - t0 < 30 and "\n" not in str(e.value)
    assert f"mlflow: connecting to {uri}" in capsys.readouterr().err
    assert not (tmp_path / "run").exists()  # refused before the run directory


@pytest.fixture
def server():
    """server(status) -> the URI of a local HTTP server answering every GET with ``status``; status None: a server
    that accepts connections and never answers."""
    opened = []

    def start(status, cert: tuple[Path, Path] | None = None):
        if status is None:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            opened.append(sock)
            return f"http://127.0.0.1:{sock.getsockname()[1]}"

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.end_headers()
                self.wfile.write(b'{"experiments": []}')

            def log_message(self, *args):
                pass

        httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if cert:
            context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
            context.load_cert_chain(*cert)
            httpd.socket = context.wrap_socket(httpd.socket, server_side=True)
        threading.Thread(target=httpd.serve_forever, daemon=True).start()
        opened.append(httpd)
        return f"{'https' if cert else 'http'}://127.0.0.1:{httpd.server_address[1]}/"

    yield start
    for thing in opened:
        if isinstance(thing, socket.socket):
            thing.close()
        else:
            thing.shutdown()
            thing.server_close()


@pytest.mark.parametrize("status, problem", [(200, None), (401, None), (404, "answered HTTP 404 Not Found"),
                                             (502, "answered HTTP 502 Bad Gateway"),
                                             (None, "could not be reached (timed out; waited at most 0.5 s)")])
def test_the_mlflow_reachability_check(server, status, problem):
    from exactrl.tracking import reach_mlflow

    uri = server(status)
    if problem is None:  # an MLflow server (or one behind authentication, whose credentials MLflow handles)
        reach_mlflow(uri, timeout_s=0.5)
        return
    with pytest.raises(ConfigError, match=re.escape(problem)):
        reach_mlflow(uri, timeout_s=0.5)


def test_a_run_config_written_before_mode_defaulted_to_unset_still_loads(tmp_path):
    """config.yaml of runs before this change holds log.wandb.mode: online with no project; replays must load it."""
    old = tmp_path / "config.yaml"
    old.write_text(yaml.safe_dump({"log": {"wandb": {"project": None, "mode": "online"}}}))
    assert load_config(SFTConfig, old, []).log.wandb.mode == "online"


def test_only_the_deprecations_deepspeed_causes_are_hidden():
    """torch's own FutureWarnings for the collectives DeepSpeed calls (one per rank in every multi-rank DeepSpeed run)
    are hidden once a DeepSpeed engine starts; any other FutureWarning still shows."""
    import torch
    import torch.distributed as dist

    from exactrl.distributed.deepspeed_engine import hide_deprecations_deepspeed_causes

    def shown() -> list[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            hide_deprecations_deepspeed_causes()
            for collective in (dist.all_gather_into_tensor, dist.reduce_scatter_tensor):
                with pytest.raises(ValueError):  # warned, then refused: no process group here
                    collective(torch.zeros(2), torch.zeros(2))
            warnings.warn("something else is deprecated", FutureWarning, stacklevel=1)
        return [str(w.message) for w in caught]

    assert shown() == ["something else is deprecated"]


@pytest.mark.skipif(shutil.which("openssl") is None, reason="makes its certificate with openssl")
def test_an_https_mlflow_server_with_a_certificate_python_does_not_trust_is_left_to_mlflow(server, tmp_path):
    """A self-signed server that MLflow is told to trust (MLFLOW_TRACKING_INSECURE_TLS...) answered: not refused."""
    from exactrl.tracking import reach_mlflow

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    reach_mlflow(server(200, cert=(cert, key)), timeout_s=2)
