"""The simulator's typed inputs: a cluster, a job and a trace spec, from YAML (pure but the reads).

Each is a frozen dataclass built by the job config's own builder (``config.build_tree``: unknown
keys rejected with the closest one, types checked, the dotted key named), then checked.

- ``Cluster``: a device kind (a shipped device profile, ``trainer/controller/profiles``, or a
  profile YAML), devices per node, nodes, and optional link overrides per class (bytes/s, s).
  ``profile()`` is the controller's ``DeviceProfile`` with those overrides.
- ``JobInput``: a model by its HF ``config.json`` shape (a shipped one under
  ``configs/simulate/models/`` by name, or a directory holding a ``config.json``), the
  algorithm, the batch, prompt and response lengths, the initial plan (``auto``: the plan the
  controller's search chooses for the longest step, the one a static run must survive) and
  the controller's settings. ``job_config(devices)`` is the ``JobConfig`` every policy plans
  with: the same loader and validation as ``nereus train`` (a dataset job whose files are
  never opened).
- ``WorldInput``: the job's draw of the world (``world/``): the seed of its device speeds,
  hidden slacks and noise, whether it is noisy, the seconds of a restart. The world's
  parameters are the cluster's ``world`` (a file of ``configs/simulate/worlds/``, by name
  or path; default: the cluster's ``device``), with the cluster's ``memory_gib`` and
  ``devices_per_node`` where given. ``load_world(cluster, job)`` builds the ``World``.

Every error is a ``SimulateError`` naming the file and the key.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import yaml

from ..config import DEFAULT_ALGORITHM, Algorithm, ConfigError, JobConfig, YamlLoader, build_tree
from ..controller.profiles import Link, ProfileError, load_profile
from ..prepare import load_config

MODELS = Path(__file__).resolve().parents[2] / "configs" / "simulate" / "models"
"""Shipped HF config shapes, one directory each (``<name>/config.json``)."""


class SimulateError(ValueError):
    """Simulator input that cannot run; the message names the file, key or line."""


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkInput:
    bandwidth: float | None = None  # bytes/s (None: the profile's)
    latency: float | None = None  # s (None: the profile's)


@dataclass(frozen=True, kw_only=True, slots=True)
class Cluster:
    name: str = "cluster"
    device: str = "h200"  # a shipped device profile or a profile YAML
    devices_per_node: int | None = None  # None: the profile's
    nodes: int = 1
    memory_gib: float | None = None  # per device (None: the profile's)
    world: str | None = None  # the world's parameters: a shipped name (configs/simulate/worlds) or a file (None: the device's)
    links: Any = None  # {intra|inter|local: {bandwidth, latency}}: overrides of the profile's

    @property
    def devices(self) -> int:
        return self.nodes * self.per_node

    @property
    def per_node(self) -> int:
        return self.devices_per_node or self.profile().devices_per_node

    def profile(self):
        """The controller's DeviceProfile of this cluster (its overrides applied)."""
        try:
            base = load_profile(self.device)
        except ProfileError as e:
            raise SimulateError(f"cluster key 'device': {e}") from None
        links = dict(base.links)
        for cls, given in (self.links or {}).items():
            if cls not in links:
                raise SimulateError(f"cluster key 'links.{cls}': unknown link class; known: {', '.join(links)}")
            over = build_tree(LinkInput, given or {}, f"links.{cls}.")
            for key in ("bandwidth", "latency"):
                value = getattr(over, key)
                if value is not None and value <= 0:
                    raise SimulateError(f"cluster key 'links.{cls}.{key}' must be > 0, got {value!r}")
            links[cls] = Link(bandwidth=over.bandwidth or links[cls].bandwidth, latency=over.latency or links[cls].latency)
        return dataclasses.replace(base, links=links, devices_per_node=self.devices_per_node or base.devices_per_node,
                                   memory_gib=self.memory_gib or base.memory_gib)


@dataclass(frozen=True, kw_only=True, slots=True)
class LengthsInput:
    mean: float = 512.0  # tokens
    max: int = 1024


@dataclass(frozen=True, kw_only=True, slots=True)
class ResponseInput:
    max: int = 8192  # rollout.max_new_tokens: the longest response the job allows
    mean: float | None = None  # the declared mean response (the initial plan's search; None: the longest)


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldInput:
    """The job's draw of the world (``world/``); the controller never reads it."""

    seed: int = 1234  # device speeds, hidden allocator slacks per layout class, stragglers, noise
    noise: bool = True  # stragglers and per-step noise on what the controller measures
    restart_seconds: float = 300.0  # a failed or out-of-memory step: restart from the staged state


@dataclass(frozen=True, kw_only=True, slots=True)
class JobInput:
    name: str = "job"
    model: str = "llama-3.1-8b"  # a shipped shape (configs/simulate/models/<name>) or a directory with a config.json
    critic: str | None = None  # None: the actor's shape
    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    algorithm: Algorithm = DEFAULT_ALGORITHM
    prompts_per_step: int = 256
    samples_per_prompt: int = 4
    minibatch_size: int = 1024
    epochs: int = 1
    kl_coef: float = 0.001
    prompt: LengthsInput = field(default_factory=LengthsInput)
    response: ResponseInput = field(default_factory=ResponseInput)
    plan: Any = "auto"  # "auto" or a plan section as in a job config
    controller: Any = None  # a job config's controller section (drift, gamma, hysteresis, lookahead, ...)
    world: WorldInput = field(default_factory=WorldInput)

    @property
    def rows(self) -> int:
        return self.prompts_per_step * self.samples_per_prompt

    def model_dir(self, name: str) -> str:
        if os.path.isfile(os.path.join(name, "config.json")):
            return name
        shipped = MODELS / name
        if (shipped / "config.json").is_file():
            return str(shipped)
        known = sorted(p.name for p in MODELS.iterdir() if (p / "config.json").is_file())
        raise SimulateError(f"job key 'model': {name!r} is neither a shipped model shape ({', '.join(known)}) nor a directory with a config.json")

    def job_config(self, devices: int, *, steps: int, profile_path: str, memory_gib: float, plan: Any = None) -> JobConfig:
        """The JobConfig of this job on ``devices`` devices of the profile at ``profile_path``
        (``plan``: this plan instead of the job's)."""
        plan = self.plan if plan is None else plan
        longest = self.prompt.max + self.response.max
        model = {"path": self.model_dir(self.model), "dtype": self.dtype, "max_seq_len": longest}
        data: dict = {
            "algorithm": self.algorithm, "steps": steps, "nproc": devices, "run_dir": "unused", "checkpoint_every": 0,
            "device_profile": profile_path, "device_memory_gib": memory_gib,
            "model": model, "data": {"train_files": ["simulated"], "max_prompt_length": self.prompt.max},
            "rollout": {"prompts_per_step": self.prompts_per_step, "samples_per_prompt": self.samples_per_prompt,
                        "max_new_tokens": self.response.max},
            self.algorithm: {"epochs": self.epochs, "minibatch_size": self.minibatch_size, "kl_coef": self.kl_coef},
            "controller": {**(self.controller or {}), "enabled": True}, "plan": plan,
        }
        if self.critic is not None:
            data["critic"] = {"path": self.model_dir(self.critic), "dtype": self.dtype, "max_seq_len": longest}
        return load_config(data)


def write_profile(profile, path: str) -> str:
    """A DeviceProfile as the YAML ``load_profile`` reads (the cluster's, for its JobConfig)."""
    data = {"name": profile.name, "kind": profile.kind, "memory_gib": profile.memory_gib, "devices_per_node": profile.devices_per_node,
            "flops": dict(profile.flops), "memory_bandwidth": profile.memory_bandwidth, "op_overhead": profile.op_overhead,
            "links": {k: {"bandwidth": v.bandwidth, "latency": v.latency} for k, v in profile.links.items()}}
    if profile.cores:
        data["cores"] = profile.cores
    if profile.efficiency:
        data["efficiency"] = dict(profile.efficiency)
    Path(path).write_text(yaml.safe_dump(data, sort_keys=False))
    return path


def read_yaml(path: str | os.PathLike, what: str) -> dict:
    if not os.path.isfile(path):
        raise SimulateError(f"{what} file {os.fspath(path)!r} does not exist")
    try:
        data = yaml.load(Path(path).read_text(), Loader=YamlLoader)
    except yaml.YAMLError as e:
        raise SimulateError(f"{path}: not valid YAML ({e})") from None
    if not isinstance(data, dict):
        raise SimulateError(f"{path}: a {what} is a mapping at the top level")
    return data


FREE = {Cluster: ("links",), JobInput: ("plan", "controller")}
"""Fields the typed builder leaves as they are (mappings checked where they are used)."""


def build(cls: type, data: dict, prefix: str = "") -> Any:
    """``config.build_tree`` of ``cls``, with its ``FREE`` fields (and a nested ``world``) taken apart."""
    data = dict(data)
    free = {k: data.pop(k) for k in FREE.get(cls, ()) if k in data}
    for key in free:
        if free[key] is not None and not isinstance(free[key], (dict, str)):
            raise SimulateError(f"{prefix}{key} must be a mapping, got {type(free[key]).__name__} {free[key]!r}")
    if cls is JobInput and "truth" in data:
        raise SimulateError("job key 'truth': the hidden truth is now the world; use 'world' (seed, noise, restart_seconds) "
                            "and the cluster's 'world' (its parameter file)")
    world = data.pop("world", None) if cls is JobInput else None
    out = build_tree(cls, data, prefix)
    if world is not None:
        if not isinstance(world, dict):
            raise SimulateError(f"job key 'world' must be a mapping, got {world!r}")
        free["world"] = build_tree(WorldInput, world, "world.")
    return dataclasses.replace(out, **free) if free else out


def load_cluster(source: str | os.PathLike | dict) -> Cluster:
    where = "" if isinstance(source, dict) else f"{os.fspath(source)}: "
    try:
        cluster = build(Cluster, source if isinstance(source, dict) else read_yaml(source, "cluster"))
        if cluster.nodes < 1 or (cluster.devices_per_node is not None and cluster.devices_per_node < 1):
            raise SimulateError(f"cluster key '{'nodes' if cluster.nodes < 1 else 'devices_per_node'}' must be >= 1")
        if cluster.memory_gib is not None and cluster.memory_gib <= 0:
            raise SimulateError(f"cluster key 'memory_gib' must be > 0, got {cluster.memory_gib!r}")
        cluster.profile()
    except (ConfigError, SimulateError) as e:
        raise SimulateError(f"{where}{str(e).replace('config key', 'cluster key')}") from None
    return cluster


def load_job(source: str | os.PathLike | dict) -> JobInput:
    where = "" if isinstance(source, dict) else f"{os.fspath(source)}: "
    try:
        job = build(JobInput, source if isinstance(source, dict) else read_yaml(source, "job"))
        checks = [("prompts_per_step", job.prompts_per_step >= 1), ("samples_per_prompt", job.samples_per_prompt >= 1),
                  ("minibatch_size", 1 <= job.minibatch_size), ("epochs", job.epochs >= 1), ("prompt.max", job.prompt.max >= 1),
                  ("prompt.mean", 0 < job.prompt.mean <= job.prompt.max), ("response.max", job.response.max >= 1),
                  ("response.mean", job.response.mean is None or 0 < job.response.mean <= job.response.max),
                  ("world.restart_seconds", job.world.restart_seconds >= 0)]
        for key, ok in checks:
            if not ok:
                raise SimulateError(f"job key '{key}' is out of range")
        if job.rows % job.minibatch_size and job.minibatch_size < job.rows:
            raise SimulateError(f"job key 'minibatch_size'={job.minibatch_size} must divide the batch ({job.rows} rows)")
        job.model_dir(job.model)
        if job.critic is not None:
            job.model_dir(job.critic)
    except (ConfigError, SimulateError) as e:
        raise SimulateError(f"{where}{str(e).replace('config key', 'job key')}") from None
    return job


def world_params(cluster: Cluster):
    """The world's parameters of ``cluster`` (its ``world``, else its device's), with the
    cluster's ``memory_gib`` and ``devices_per_node`` where it gives them."""
    from .world import WorldError, load_world_params

    name = cluster.world or cluster.device
    try:
        params = load_world_params(name)
    except WorldError as e:
        raise SimulateError(f"cluster {cluster.name!r} key '{'world' if cluster.world else 'device'}': {e}") from None
    over = {k: v for k, v in (("memory_gib", cluster.memory_gib), ("devices_per_node", cluster.devices_per_node)) if v is not None}
    return dataclasses.replace(params, **over) if over else params


def load_world(cluster: Cluster, job: JobInput, *, noise: bool | None = None, prompt_mean: float | None = -1.0):
    """The ``World`` ``job`` runs in on ``cluster`` (``noise``: None, the job's;
    ``prompt_mean``: -1, the job's declared mean)."""
    from .world import World

    return World(world_params(cluster), seed=job.world.seed, noise=job.world.noise if noise is None else noise,
                 prompt_mean=job.prompt.mean if prompt_mean == -1.0 else prompt_mean)
