"""Experiment trackers: every metrics.jsonl record's scalars, also in TensorBoard, W&B or MLflow when log.* asks.

metrics.jsonl stays the record of a run (exactrl/metrics.py); a tracker receives each record's
numeric values (int, float, bool; not None, not lists) as ``<phase>/<key>`` at ``record["step"]``,
and the run's config and manifest as metadata. Each tracker is an optional package, imported
only when asked for and checked before the run directory is created.
"""

from __future__ import annotations

import importlib
import json
import os
import shutil
import ssl
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from urllib.parse import urlparse

from exactrl.config.loader import ConfigError
from exactrl.metrics import MetricsLog

# Keys of a record that say where it belongs rather than what was measured.
NOT_SCALARS = ("phase", "step", "time")
# The run directory's files every tracker receives as metadata (sent again at the end: the start-up checks
# add their figures to the manifest after the trackers have started).
METADATA = ("config.yaml", "manifest.json")
# How long an MLflow server may take to answer its health check before the run is refused.
REACH_TIMEOUT_S = 5.0


def requested(log) -> list[tuple[str, str, str]]:
    """(config key, module to import, pip extra) of each tracker the log section asks for."""
    wanted = [("log.tensorboard", "tensorboard", "tensorboard")] if log.tensorboard else []
    wanted += [("log.wandb.project", "wandb", "wandb")] if log.wandb.project else []
    wanted += [("log.mlflow.uri", "mlflow", "mlflow")] if log.mlflow.uri else []
    return wanted


def require_trackers(log, reach_servers: bool = True) -> None:
    """Fail in one line, before anything is written, when an asked-for tracker's package is missing or (with
    ``reach_servers``: the process that will log) its MLflow server does not answer."""
    for key, module, extra in requested(log):
        try:
            importlib.import_module(module)
        except ImportError as e:
            raise ConfigError(f"{key} needs the '{module}' package, which does not import ({e}): "
                              f"pip install 'exactrl[{extra}]', or unset {key}") from None
    if reach_servers and log.mlflow.uri and urlparse(log.mlflow.uri).scheme in ("http", "https"):
        reach_mlflow(log.mlflow.uri)


def reach_mlflow(uri: str, timeout_s: float = REACH_TIMEOUT_S) -> None:
    """One request of the API the run will use, so that a wrong address or a server that is down fails in seconds:
    MLflow's client retries each call with exponential backoff, about 270 s of silence before its error."""
    print(f"mlflow: connecting to {uri} ...", file=sys.stderr, flush=True)
    url = uri.rstrip("/") + "/api/2.0/mlflow/experiments/search?max_results=1"
    try:
        with urllib.request.urlopen(url, timeout=timeout_s):
            return
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):  # an MLflow server behind authentication: the credentials are MLflow's business
            return
        # 404 or 5xx: not an MLflow server, or a gateway that cannot reach one (MLflow would retry it for minutes)
        problem = f"answered HTTP {e.code} {e.reason}: not an MLflow tracking server, or a proxy that cannot reach one"
    except (OSError, ValueError) as e:  # refused, unknown host, timed out, malformed address
        if isinstance(getattr(e, "reason", e), ssl.SSLCertVerificationError):
            return  # it answered in TLS; which certificates to trust MLflow decides (MLFLOW_TRACKING_INSECURE_TLS...)
        reason = " ".join(str(getattr(e, "reason", e)).split())
        problem = f"could not be reached ({reason}; waited at most {timeout_s:g} s)"
    raise ConfigError(f"log.mlflow.uri={uri}: {url} {problem}; start the server or fix the address, "
                      f"or unset log.mlflow.uri")


def scalars(record: dict) -> dict[str, float]:
    """``<phase>/<key>`` -> value of each numeric value of a record (lists, dicts, None: metrics.jsonl only)."""
    phase = record.get("phase", "")
    return {f"{phase}/{k}": float(v) for k, v in record.items()
            if k not in NOT_SCALARS and isinstance(v, (int, float))}


def flat_config(cfg) -> dict:
    """The resolved config as dotted keys (``train.seed``), the form MLflow params and the W&B config table take."""
    out, stack = {}, [("", cfg.model_dump(mode="json"))]
    while stack:
        prefix, node = stack.pop()
        for k, v in node.items():
            if isinstance(v, dict):
                stack.append((f"{prefix}{k}.", v))
            else:
                out[f"{prefix}{k}"] = v
    return dict(sorted(out.items()))


class TensorBoard:
    """Event files in <run>/tensorboard/, each value as a classic scalar summary: the form EventAccumulator.Scalars
    and the dashboards' scalar views read (a tensor summary, even of the scalars plugin, they skip). Its field is
    a float32, so TensorBoard shows each value rounded to 7 digits; metrics.jsonl keeps them exact."""

    def __init__(self, log, run_dir: Path, name: str, params: dict):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = run_dir
        self.writer = SummaryWriter(log_dir=str(run_dir / "tensorboard"))
        self._texts(0)

    def _texts(self, step: int) -> None:
        for name in METADATA:
            if (self.run_dir / name).is_file():
                # Indented: TensorBoard renders text as Markdown, and a code block keeps YAML/JSON as written.
                text = (self.run_dir / name).read_text()
                self.writer.add_text(name, "\n".join("    " + line for line in text.splitlines()), step)

    def log(self, step: int, values: dict[str, float]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a run that crashes keeps what it logged

    def close(self, last_step: int) -> None:
        self._texts(last_step)
        self.writer.close()


class WandB:
    """A W&B run whose local copy is <run>/wandb/ (offline: only that; `wandb sync` uploads it later)."""

    def __init__(self, log, run_dir: Path, name: str, params: dict):
        import wandb

        w = log.wandb
        self.run_dir = run_dir
        # An unset key is passed as None, which W&B fills from its documented WANDB_* variables (WANDB_MODE=offline
        # on a cluster without network, WANDB_ENTITY...); a value here would override them.
        default_name = None if "WANDB_NAME" in os.environ else name
        self.run = wandb.init(project=w.project, entity=w.entity, name=w.name or default_name, mode=w.mode,
                              dir=str(run_dir), config=params)
        self._files()

    def _files(self) -> None:
        for name in METADATA:  # files in the W&B run's own directory are its run files
            if (self.run_dir / name).is_file():
                shutil.copyfile(self.run_dir / name, Path(self.run.dir) / name)

    def log(self, step: int, values: dict[str, float]) -> None:
        self.run.log(values, step=step)

    def close(self, last_step: int) -> None:
        self._files()
        self.run.finish()


class MLflow:
    """An MLflow run in experiment log.mlflow.experiment: params = the flat config; config and manifest as artifacts."""

    def __init__(self, log, run_dir: Path, name: str, params: dict):
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        m = log.mlflow
        if urlparse(m.uri).scheme in ("", "file"):
            # MLflow 3 refuses its file store unless told otherwise; log.mlflow.uri asked for exactly that store.
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.run_dir, self.client = run_dir, MlflowClient(m.uri)
        experiment = self.client.get_experiment_by_name(m.experiment)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(m.experiment)
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        items = [Param(k, v if isinstance(v, str) else json.dumps(v)) for k, v in params.items()]
        for i in range(0, len(items), 100):  # MLflow takes at most 100 params per batch
            self.client.log_batch(self.run_id, params=items[i: i + 100])
        self._artifacts()

    def _artifacts(self) -> None:
        for name in METADATA:
            if (self.run_dir / name).is_file():
                self.client.log_artifact(self.run_id, str(self.run_dir / name))

    def log(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        self.client.log_batch(self.run_id, metrics=[Metric(k, v, now, step) for k, v in values.items()])

    def close(self, last_step: int) -> None:
        self._artifacts()
        self.client.set_terminated(self.run_id)


TRACKERS = {"log.tensorboard": TensorBoard, "log.wandb.project": WandB, "log.mlflow.uri": MLflow}


class Sinks:
    """MetricsLog's interface (write, close) over metrics.jsonl and the trackers."""

    def __init__(self, jsonl: MetricsLog, trackers: list):
        self.jsonl, self.trackers, self.last_step = jsonl, trackers, 0

    def write(self, record: dict) -> None:
        self.jsonl.write(record)
        step, values = record.get("step"), scalars(record)
        if isinstance(step, int) and values:
            self.last_step = step
            for tracker in self.trackers:
                tracker.log(step, values)

    def close(self) -> None:
        self.jsonl.close()
        for tracker in self.trackers:
            tracker.close(self.last_step)


def open_metrics(cfg, run_dir: Path, name: str) -> MetricsLog | Sinks:
    """<run>/metrics.jsonl, plus the trackers cfg.log asks for (``name``: their run name unless log.* gives one)."""
    jsonl = MetricsLog(run_dir / "metrics.jsonl")
    wanted = requested(cfg.log)
    if not wanted:
        return jsonl
    params = flat_config(cfg)
    trackers = []
    for key, _, _ in wanted:
        try:
            trackers.append(TRACKERS[key](cfg.log, run_dir, name, params))
        except Exception as e:  # a tracker that cannot start (no server, no login) is a set-up problem, not a bug
            Sinks(jsonl, trackers).close()
            reason = " ".join(str(e).split())  # one line, whatever the library's message looks like
            raise ConfigError(f"{key}: the tracker could not start ({type(e).__name__}: {reason}); "
                              f"fix it or unset {key}") from None
    return Sinks(jsonl, trackers)
