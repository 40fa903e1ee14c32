"""Trackers: where each step's metrics go besides ``RUN_DIR/metrics.jsonl`` (rank 0 only).

``logging.trackers`` picks them: ``console`` (a line every ``logging.console_every`` steps,
and a progress bar when stderr is a terminal), ``tensorboard`` (``RUN_DIR/tensorboard``),
``wandb`` and ``mlflow`` (optional extras: ``pip install 'nereus[wandb]'``, ``'nereus[mlflow]'``).
Every tracker gets the same record: ``log.flatten`` of the step's metrics (numeric leaves
as ``a/b`` keys), at the step's number.

Call order (``MetricsLog``, rank 0): ``open_trackers`` once; ``log(step, values, record)``
once per step (a validation before the first step is step 0); ``close()`` once at the end
(also after a failed step), which attaches the run record
to wandb and MLflow: the resolved config (wandb: the run's config; MLflow: its params and
``config.json``), the plan history (``plan_history.json``: the first step of every plan the
run ran in, from metrics.jsonl's ``plan``) and, with the controller, ``transitions.jsonl``.

Resume: a run started at ``first_step > 0`` continues the wandb and MLflow runs its run
directory names (``RUN_DIR/trackers.json``), and TensorBoard purges the later steps. Shortcut:
steps that a crashed attempt logged after its last checkpoint cannot be taken back from wandb
or MLflow: MLflow then holds both values at those steps, and an online wandb run keeps the
crashed attempt's (it ignores steps at or below its last); metrics.jsonl and TensorBoard hold
each step once.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import sys
import time
from typing import Any, Protocol, TextIO

EXTRAS = {"wandb": "wandb", "mlflow": "mlflow"}
"""Tracker -> the module it needs (each an extra of the nereus package, by the same name)."""


class Tracker(Protocol):
    """One destination of the metrics; see the module docstring for the call order."""

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        """``values``: the flattened numeric metrics; ``record``: the step's whole record."""

    def close(self, *, failed: bool = False) -> None:
        """``failed``: the run stopped on an error."""


def flush_trackers(trackers) -> None:
    """Everything the trackers were given, written out (those with a ``flush``: TensorBoard):
    the step loop calls it before a checkpoint or staged copy of the step commits, so a
    worker killed after the commit loses no step a restore will not run again."""
    for tracker in trackers:
        flush = getattr(tracker, "flush", None)
        if flush is not None:
            flush()


def missing_trackers(trackers) -> list[str]:
    """The trackers whose package is not importable here (without importing it)."""
    out = []
    for name in trackers:
        module = EXTRAS.get(name)
        if module is None:
            continue
        try:
            found = importlib.util.find_spec(module) is not None
        except (ImportError, ValueError):  # ValueError: sys.modules holds None for it (import blocked)
            found = False
        if not found:
            out.append(name)
    return out


def check_trackers(trackers) -> None:
    """ConfigError naming the first tracker whose package is not installed here (``nereus
    train`` calls it before any worker starts)."""
    from ..config import ConfigError

    missing = missing_trackers(trackers)
    if missing:
        name = missing[0]
        raise ConfigError(f"config key 'logging.trackers' has {name!r}, but the {EXTRAS[name]} package is not installed: "
                          f"pip install 'nereus[{name}]', or drop it from logging.trackers")
    if "wandb" in trackers and not _wandb_can_log():
        raise ConfigError("config key 'logging.trackers' has 'wandb', but wandb has no API key here (WANDB_API_KEY, "
                          "`wandb login` or ~/.netrc): log in, or set WANDB_MODE=offline (then `wandb sync` uploads)")


def _wandb_can_log() -> bool:
    """Offline or disabled modes need no key; online needs one (environment or netrc), read
    the way wandb reads them, without importing wandb."""
    import netrc

    if os.environ.get("WANDB_MODE", "").lower() in ("offline", "disabled", "dryrun") or os.environ.get("WANDB_API_KEY"):
        return True
    host = os.environ.get("WANDB_BASE_URL", "https://api.wandb.ai").split("//")[-1].split("/")[0]
    path = os.environ.get("NETRC", os.path.expanduser("~/.netrc"))
    try:
        return netrc.netrc(path).authenticators(host) is not None
    except (OSError, netrc.NetrcParseError):
        return False


def open_trackers(settings, run_dir: str, *, config: dict | None, total: int, first_step: int) -> list[Tracker]:
    """The trackers of ``settings`` (a ``LoggingConfig``), opened in ``run_dir``."""
    ids = _load_ids(run_dir) if first_step > 0 else {}
    out: list[Tracker] = []
    for name in settings.trackers:
        if name == "console":
            out.append(Console(every=settings.console_every, total=total, first_step=first_step))
        elif name == "tensorboard":
            tb = TensorBoard.open(run_dir, first_step)
            if tb is not None:
                out.append(tb)
        elif name == "wandb":
            out.append(Wandb(settings, run_dir, config=config, run_id=ids.get("wandb")))
        elif name == "mlflow":
            out.append(MLflow(settings, run_dir, config=config, run_id=ids.get("mlflow")))
        else:
            raise ValueError(f"unknown tracker {name!r}")
    opened = {t.name: t.run_id for t in out if getattr(t, "run_id", None)}
    if opened:
        with open(os.path.join(run_dir, "trackers.json"), "w") as f:
            json.dump({**ids, **opened}, f)
    return out


def _load_ids(run_dir: str) -> dict[str, str]:
    try:
        with open(os.path.join(run_dir, "trackers.json")) as f:
            return dict(json.load(f))
    except (OSError, ValueError):
        return {}


# --------------------------------------------------------------------------- console


CONSOLE_FIELDS = (("reward_mean", ".4f"), ("kl", ".4g"), ("response_length", ".1f"), ("step_seconds", ".2f"),
                  ("tokens_per_s", ".0f"), ("actor/lr", ".3e"), ("critic/lr", ".3e"), ("val/reward_mean", ".4f"))


def console_line(step: int, total: int, record: dict[str, Any], *, now: float | None = None) -> str:
    """One step in one log line, logfmt (``key=value``, the metrics.jsonl names):

        2026-12-01 16:40:12 step=12/40 reward_mean=0.4120 kl=0.00312 response_length=3.6 step_seconds=1.52 tokens_per_s=1234 actor/lr=2.000e-03

    Fields the record lacks (a critic under GRPO, validation on other steps) are left out."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(time.time() if now is None else now))
    parts = [stamp, f"step={step}/{total}"]
    for key, spec in CONSOLE_FIELDS:
        value = record.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{key}={value:{spec}}")
    return " ".join(parts)


class Console:
    """``console_line`` every ``every`` steps and at the last, to ``stream`` (stdout); a
    tqdm bar on stderr only when stderr is a terminal (in a log file it would be noise)."""

    name = "console"

    def __init__(self, *, every: int, total: int, first_step: int = 0, stream: TextIO | None = None, bar: bool | None = None):
        self.every, self.total, self.stream = every, total, stream
        self.bar = _bar(total, first_step) if (sys.stderr.isatty() if bar is None else bar) else None

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        if "reward_mean" not in record:  # a validation before the first step: no step line
            return
        if self.bar is not None:
            self.bar.set_postfix(reward=f"{record['reward_mean']:.3f}", kl=f"{record.get('kl', 0.0):.4f}",
                                 tok_s=f"{record.get('tokens_per_s', 0.0):.0f}")
            self.bar.update(1)
        if step % self.every == 0 or step == self.total:
            line = console_line(step, self.total, record)
            stream = self.stream or sys.stdout
            if self.bar is not None:
                self.bar.write(line, file=stream)
            else:
                print(line, file=stream, flush=True)

    def close(self, *, failed: bool = False) -> None:
        if self.bar is not None:
            self.bar.close()


def _bar(total: int, first: int):
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, initial=first, desc="steps", unit="step", file=sys.stderr, dynamic_ncols=True)


# --------------------------------------------------------------------------- TensorBoard


class TensorBoard:
    """Scalars in ``RUN_DIR/tensorboard``; ``purge_step=first_step + 1`` makes readers drop
    the later steps an earlier attempt logged (``MetricsLog``)."""

    name = "tensorboard"

    def __init__(self, writer) -> None:
        self.writer = writer

    @classmethod
    def open(cls, run_dir: str, first_step: int) -> TensorBoard | None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:  # tensorboard is a dependency; tolerate its absence in slim installs
            return None
        return cls(SummaryWriter(os.path.join(run_dir, "tensorboard"), purge_step=first_step + 1))

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        for key, value in values.items():
            self.writer.add_scalar(key, value, step)

    def flush(self) -> None:
        """The logged scalars on disk now (SummaryWriter otherwise flushes every 120 s)."""
        self.writer.flush()

    def close(self, *, failed: bool = False) -> None:
        self.writer.close()


# --------------------------------------------------------------------------- the run record


def plan_history(run_dir: str) -> list[dict]:
    """``[{"step": s, "plan": {model-stage: layout}}]``: the first step of every plan the run
    ran in, from ``metrics.jsonl`` (torn lines skipped)."""
    out: list[dict] = []
    try:
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            lines = f.readlines()
    except OSError:
        return out
    for line in lines:
        try:
            record = json.loads(line)
        except ValueError:
            continue
        plan = record.get("plan") if isinstance(record, dict) else None
        if plan and (not out or out[-1]["plan"] != plan):
            out.append({"step": record["step"], "plan": plan})
    return out


def run_record(run_dir: str, config: dict | None) -> dict[str, str]:
    """Attachment name -> its file: ``config.json``, ``plan_history.json`` (written here) and,
    where the controller wrote it, ``transitions.jsonl``."""
    out = {}
    if config is not None:
        path = os.path.join(run_dir, "config.json")
        if not os.path.exists(path):
            with open(path, "w") as f:
                json.dump(config, f, indent=1)
        out["config.json"] = path
    path = os.path.join(run_dir, "plan_history.json")
    with open(path, "w") as f:
        json.dump(plan_history(run_dir), f, indent=1)
    out["plan_history.json"] = path
    path = os.path.join(run_dir, "transitions.jsonl")
    if os.path.exists(path):
        out["transitions.jsonl"] = path
    return out


def _flat_params(config: dict, prefix: str = "") -> dict[str, str]:
    """A nested config as ``a.b`` -> string value (lists as JSON), for MLflow params."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat_params(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = json.dumps(value) if isinstance(value, (list, tuple)) else str(value)
    return out


# --------------------------------------------------------------------------- wandb


class Wandb:
    """A wandb run in ``RUN_DIR/wandb`` (``WANDB_MODE=offline`` writes it there and nowhere
    else; ``wandb sync`` uploads it later): the resolved config as its config, one history
    row per step at ``step``, the run record as files of the run at close."""

    name = "wandb"

    def __init__(self, settings, run_dir: str, *, config: dict | None, run_id: str | None) -> None:
        import wandb

        self.run_dir, self.config = run_dir, config
        self.run = wandb.init(project=settings.project, name=settings.run_name or os.path.basename(os.path.abspath(run_dir)),
                              dir=run_dir, config=config, id=run_id, resume="allow" if run_id else None)
        self.run_id = self.run.id

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        self.run.log(values, step=step)

    def close(self, *, failed: bool = False) -> None:
        for name, path in run_record(self.run_dir, self.config).items():
            shutil.copyfile(path, os.path.join(self.run.dir, name))  # files in run.dir are the run's files
        self.run.finish(exit_code=1 if failed else 0)


# --------------------------------------------------------------------------- MLflow

_MLFLOW_BAD = re.compile(r"[^0-9A-Za-z_\-. /]")
MLFLOW_BATCH = 1000  # metrics per log_batch (MLflow's limit)
MLFLOW_PARAMS = 100  # params per log_batch


class MLflow:
    """An MLflow run in experiment ``logging.project``: the resolved config as its params
    (``a.b`` keys) and ``config.json``, each step's metrics at ``step``, the run record as
    artifacts at close. The store: ``logging.mlflow_tracking_uri``, else
    ``$MLFLOW_TRACKING_URI``, else a file store in ``RUN_DIR/mlruns`` (MLflow 3 keeps file
    stores in maintenance mode behind ``MLFLOW_ALLOW_FILE_STORE``, which is set for a
    ``file:`` URI)."""

    name = "mlflow"

    def __init__(self, settings, run_dir: str, *, config: dict | None, run_id: str | None) -> None:
        uri = settings.mlflow_tracking_uri or os.environ.get("MLFLOW_TRACKING_URI") or "file:" + os.path.abspath(os.path.join(run_dir, "mlruns"))
        if uri.startswith("file:") or "://" not in uri:
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        from mlflow.entities import Param
        from mlflow.tracking import MlflowClient

        self.client, self.run_dir, self.config = MlflowClient(tracking_uri=uri), run_dir, config
        if run_id is not None:
            self.client.update_run(run_id, status="RUNNING")
            self.run_id = run_id
            return
        experiment = self.client.get_experiment_by_name(settings.project)
        experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(settings.project)
        name = settings.run_name or os.path.basename(os.path.abspath(run_dir))
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        params = [Param(k[:250], v[:6000]) for k, v in _flat_params(config or {}).items()]
        for i in range(0, len(params), MLFLOW_PARAMS):
            self.client.log_batch(self.run_id, params=params[i : i + MLFLOW_PARAMS])

    def log(self, step: int, values: dict[str, float], record: dict[str, Any]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_MLFLOW_BAD.sub("_", k), v, now, step) for k, v in values.items()]
        for i in range(0, len(metrics), MLFLOW_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + MLFLOW_BATCH])

    def close(self, *, failed: bool = False) -> None:
        for path in run_record(self.run_dir, self.config).values():
            self.client.log_artifact(self.run_id, path)
        self.client.set_terminated(self.run_id, status="FAILED" if failed else "FINISHED")
