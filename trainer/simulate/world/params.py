"""The world's hardware and software parameters: typed, read from one YAML file per device kind (pure but the read).

A parameter file (``configs/simulate/worlds/<kind>.yaml``) is a mapping whose keys are
exactly the fields below, nested as the dataclasses nest; every leaf but ``name`` and
``kind`` is a number (YAML 1.2 floats: ``4e-6`` is a number here, not PyYAML's string).
Units are SI: seconds, bytes, bytes/s, FLOP/s; ``*_gib`` in GiB; efficiencies and
fractions are shares of 1.

``load_world_params(path_or_name)`` rejects, with a one-line ``WorldError`` naming the
file and the dotted key: a missing key, an unknown key (with the closest known one), a
value that is not a number, a negative number, and a zero where the maths divides by it.
A bare name (``h100``) is the shipped file of that name.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

import yaml

WORLDS = Path(__file__).resolve().parents[3] / "configs" / "simulate" / "worlds"
"""The shipped parameter files, one per device kind."""


class WorldError(ValueError):
    """A world parameter file that cannot be used; the message names the file and the key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Flops:
    """Dense peak FLOP/s of one device per compute dtype (no sparsity)."""

    float32: float
    bfloat16: float
    float16: float
    float64: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Compute:
    flops: Flops
    gemm_efficiency: float  # a large GEMM's share of the peak (the roofline's ceiling)
    gemm_half_flops: float  # FLOPs of a GEMM that reaches half of gemm_efficiency
    gemm_tile: float  # edge of a GEMM output tile (elements): wave quantisation
    compute_units: float  # SMs / CUs / cores one wave of tiles fills
    attention_efficiency: float  # fused (flash) attention forward, long sequences
    attention_backward_efficiency: float
    attention_half_length: float  # tokens per sequence at which attention reaches half its efficiency
    flash_attention: float  # 1: fused attention (no scores held); 0: scores materialised
    memory_bandwidth: float  # bytes/s of device memory (datasheet)
    memory_efficiency: float  # the share of it a streaming kernel reaches
    kernel_overhead_s: float  # per kernel (GPU) or eager op (CPU): launch and tail
    shared_cores: float  # 0: every device computes alone; n > 0: the node's ranks share n cores (CPU)


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    bandwidth: float  # bytes/s (intra: per device, as nccl-tests' busbw; nic: per node)
    latency: float  # s per message or collective step


@dataclass(frozen=True, kw_only=True, slots=True)
class Links:
    intra: Link  # NVLink / Infinity Fabric / loopback: within a node, per device
    pcie: Link  # a device's path to its NIC (GPUDirect RDMA) and to host memory
    nic: Link  # the node's network: aggregate bandwidth of its NICs


@dataclass(frozen=True, kw_only=True, slots=True)
class Software:
    dp_overlap: float  # share of the last micro-batch's backward that hides DP's gradient all-reduce
    bucket_bytes: float  # DDP bucket: the last one cannot overlap
    fsdp_prefetch_layers: float  # FSDP: layers all-gathered ahead (held unsharded at once)
    decode_step_overhead_s: float  # the rollout engine's per-token step outside the kernels (scheduler, sampler)
    stage_call_overhead_s: float  # per stage call (Python, data movement to the device)


@dataclass(frozen=True, kw_only=True, slots=True)
class Variance:
    device_sigma: float  # lognormal σ of a device's persistent slowdown, drawn per run
    straggler_probability: float  # per device and step
    straggler_slowdown: float  # factor of a straggling device on that step
    step_sigma: float  # lognormal σ of per-step, per-piece noise
    transition_sigma: float  # lognormal σ of a transition's noise


@dataclass(frozen=True, kw_only=True, slots=True)
class Memory:
    reserved_gib: float  # context, communicator buffers, libraries: never available to tensors
    workspace_mib: float  # GEMM library workspace held while a stage runs
    slack_min: float  # hidden allocator slack per layout class: drawn in [slack_min, slack_max]
    slack_max: float


@dataclass(frozen=True, kw_only=True, slots=True)
class Transitions:
    rebuild_base_s: float  # per rebuilt model-stage: modules on meta, parallelise, optimizer
    comm_init_s: float  # per rebuilt model-stage and log2(ranks): communicator bootstrap
    allocate_s_per_gib: float  # first-touch allocation of the new state, per GiB per rank


@dataclass(frozen=True, kw_only=True, slots=True)
class WorldParams:
    name: str
    kind: str  # "gpu" or "cpu"
    memory_gib: float
    devices_per_node: float
    compute: Compute
    links: Links
    software: Software
    variance: Variance
    memory: Memory
    transitions: Transitions


POSITIVE = {"memory_gib", "devices_per_node", "compute.gemm_efficiency", "compute.gemm_half_flops", "compute.gemm_tile",
            "compute.compute_units", "compute.attention_efficiency", "compute.attention_backward_efficiency",
            "compute.attention_half_length", "compute.memory_bandwidth", "compute.memory_efficiency",
            "links.intra.bandwidth", "links.pcie.bandwidth", "links.nic.bandwidth", "software.bucket_bytes",
            "variance.straggler_slowdown", "compute.flops.float32", "compute.flops.bfloat16", "compute.flops.float16",
            "compute.flops.float64"}
"""Keys the maths divides by (or scales with): > 0, not only >= 0."""
AT_MOST_ONE = {"compute.gemm_efficiency", "compute.attention_efficiency", "compute.attention_backward_efficiency",
               "compute.memory_efficiency", "software.dp_overlap", "variance.straggler_probability", "compute.flash_attention"}

_FLOAT = re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)?$")


class _Loader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-6``, ``5e10``: numbers)."""


_Loader.add_implicit_resolver("tag:yaml.org,2002:float", re.compile(r"^[-+]?(\.[0-9]+|[0-9]+(\.[0-9]*)?)([eE][-+]?[0-9]+)$"),
                              list("-+0123456789."))


def world_path(path_or_name: str | os.PathLike) -> Path:
    """A parameter file's path: the path itself, or the shipped file of a bare name."""
    p = Path(path_or_name)
    if p.suffix in (".yaml", ".yml") or p.is_file():
        return p
    return WORLDS / f"{p.name}.yaml"


def load_world_params(path_or_name: str | os.PathLike) -> WorldParams:
    """The parameters of a world file (module docstring); ``WorldError`` names the file and key."""
    path = world_path(path_or_name)
    if not path.is_file():
        known = sorted(q.stem for q in WORLDS.glob("*.yaml"))
        raise WorldError(f"world file {os.fspath(path)!r} does not exist (shipped worlds: {', '.join(known)})")
    try:
        data = yaml.load(path.read_text(), Loader=_Loader)
    except yaml.YAMLError as e:
        raise WorldError(f"{path}: not valid YAML ({' '.join(str(e).split())})") from None
    return params_from_dict(data, where=str(path))


def params_from_dict(data: object, *, where: str = "world") -> WorldParams:
    """``WorldParams`` from a mapping (the parsed file), checked key by key."""
    if not isinstance(data, dict):
        raise WorldError(f"{where}: a world file is a mapping at the top level")
    out = _build(WorldParams, data, "", where)
    if out.kind not in ("gpu", "cpu"):
        raise WorldError(f"{where}: key 'kind' must be 'gpu' or 'cpu', got {out.kind!r}")
    if out.memory.slack_max < out.memory.slack_min:
        raise WorldError(f"{where}: key 'memory.slack_max' ({out.memory.slack_max:g}) is below 'memory.slack_min' ({out.memory.slack_min:g})")
    return out


def _build(cls: type, data: dict, prefix: str, where: str):
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key in data:
        if key not in fields:
            close = difflib.get_close_matches(str(key), list(fields), n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; known: {', '.join(fields)}"
            raise WorldError(f"{where}: unknown key '{prefix}{key}'{hint}")
    values = {}
    for name, f in fields.items():
        key = prefix + name
        if name not in data:
            raise WorldError(f"{where}: key '{key}' is missing")
        value, sub = data[name], _nested(f.type)
        if sub is not None:
            if not isinstance(value, dict):
                raise WorldError(f"{where}: key '{key}' must be a mapping, got {value!r}")
            values[name] = _build(sub, value, key + ".", where)
        elif f.type in ("str", str):
            if not isinstance(value, str):
                raise WorldError(f"{where}: key '{key}' must be a string, got {value!r}")
            values[name] = value
        else:
            values[name] = _number(value, key, where)
    return cls(**values)


def _nested(tp) -> type | None:
    name = tp if isinstance(tp, str) else getattr(tp, "__name__", "")
    return {c.__name__: c for c in (Flops, Compute, Link, Links, Software, Variance, Memory, Transitions)}.get(name)


def _number(value: object, key: str, where: str) -> float:
    if isinstance(value, str) and _FLOAT.match(value.strip()):
        value = float(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise WorldError(f"{where}: key '{key}' must be a finite number, got {value!r}")
    if value < 0:
        raise WorldError(f"{where}: key '{key}' must be >= 0, got {value!r}")
    if key in POSITIVE and value == 0:
        raise WorldError(f"{where}: key '{key}' must be > 0, got {value!r}")
    if key in AT_MOST_ONE and value > 1:
        raise WorldError(f"{where}: key '{key}' is a share of 1, got {value!r}")
    return float(value)
