"""Device profiles: what one device of a hardware kind can do, as data (``profiles/*.yaml``).

A profile gives a device's memory, its dense peak FLOP/s per dtype, its memory bandwidth,
the fixed cost of one eager op (kernel launch, or CPU dispatch), and a (bandwidth bytes/s,
latency s) pair per link class: ``local`` (a copy on the device), ``intra`` (another device
of the node: NVLink, Infinity Fabric, loopback) and ``inter`` (another node). These are
priors: the step-time model (``steptime.py``) scales each operation class by an
efficiency it calibrates on the job itself.

CPU profiles also give ``cores``: ranks are processes sharing them, so a rank computes at
``flops × min(1, cores / ranks running at once)`` (``DeviceProfile.share``).

``load_profile(name_or_path)``: a shipped profile by name (``cpu``, ``a100``, ``h100``,
``h200``, ``mi250x``) or a YAML file of the same keys; a missing key, an unknown key or a
value out of range is a ``ProfileError`` naming the file and the key.
"""

from __future__ import annotations

import difflib
import os
from dataclasses import dataclass, field
from importlib import resources
from typing import Mapping

import yaml

from ..config import YamlLoader as YAML12Loader

LINK_CLASSES = ("local", "intra", "inter")
DTYPES = ("float32", "float64", "bfloat16", "float16")
OP_CLASSES = (  # the step-time model's operation classes (steptime.py), each with its θ
    "gemm", "memory", "ops", "ops_dtensor", "comm_latency", "comm_tp", "comm_pp", "comm_dp", "optimizer", "decode", "sync",
    "collective", "call",
)


class ProfileError(ValueError):
    """A device profile that is missing or malformed; the message names the file and key."""


@dataclass(frozen=True, kw_only=True, slots=True)
class Link:
    bandwidth: float  # bytes/s, one direction
    latency: float  # s per message

    def seconds(self, nbytes: float, messages: float = 1.0) -> float:
        return messages * self.latency + nbytes / self.bandwidth


@dataclass(frozen=True, kw_only=True, slots=True)
class DeviceProfile:
    name: str
    kind: str  # "cpu" | "gpu"
    memory_gib: float
    devices_per_node: int
    flops: Mapping[str, float]
    memory_bandwidth: float
    op_overhead: float
    links: Mapping[str, Link]
    cores: int | None = None
    efficiency: Mapping[str, float] = field(default_factory=dict)
    """Priors of the step-time model's θ per operation class (``OP_CLASSES``; 1
    where absent): how much slower than its peak-rate prior a class runs on this kind."""
    source: str = field(default="", compare=False)

    def share(self, ranks: int) -> float:
        """The fraction of a device's speed one of ``ranks`` busy ranks gets (CPU: the cores
        are shared; GPU: a rank is a device)."""
        if self.kind != "cpu" or not self.cores:
            return 1.0
        return min(1.0, self.cores / max(ranks, 1))

    def peak(self, dtype: str) -> float:
        return self.flops[dtype]

    def link(self, src: int, dst: int) -> Link:
        """The link between two global ranks (ranks fill nodes in order)."""
        if src == dst:
            return self.links["local"]
        same = src // self.devices_per_node == dst // self.devices_per_node
        return self.links["intra" if same else "inter"]


KEYS = {"name", "kind", "memory_gib", "devices_per_node", "flops", "memory_bandwidth", "op_overhead", "links", "cores", "efficiency"}


def shipped_profiles() -> list[str]:
    return sorted(p.name.removesuffix(".yaml") for p in resources.files(__package__).joinpath("profiles").iterdir() if p.name.endswith(".yaml"))


def load_profile(name_or_path: str) -> DeviceProfile:
    """A shipped profile by name, or a YAML file (see the module docstring)."""
    if os.path.sep in name_or_path or name_or_path.endswith((".yaml", ".yml")):
        where = name_or_path
        if not os.path.isfile(where):
            raise ProfileError(f"device profile {where!r} does not exist")
        text = open(where).read()
    else:
        entry = resources.files(__package__).joinpath("profiles", f"{name_or_path}.yaml")
        if not entry.is_file():
            raise ProfileError(f"unknown device profile {name_or_path!r}; shipped: {', '.join(shipped_profiles())} (or a YAML path)")
        where, text = f"{name_or_path} (shipped)", entry.read_text()
    try:
        data = yaml.load(text, Loader=YAML12Loader)  # noqa: S506 - a SafeLoader subclass (1e13 is a float)
    except yaml.YAMLError as e:
        raise ProfileError(f"device profile {where}: not valid YAML ({e})") from None
    return parse_profile(data, where)


def parse_profile(data: object, where: str = "device profile") -> DeviceProfile:
    """A DeviceProfile from a mapping, every key checked."""
    if not isinstance(data, dict):
        raise ProfileError(f"{where}: a profile is a mapping of {sorted(KEYS)}")
    for key in data:
        if key not in KEYS:
            close = difflib.get_close_matches(str(key), sorted(KEYS), n=1)
            raise ProfileError(f"{where}: unknown key {key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
    for key in sorted(KEYS - {"cores", "efficiency"}):
        if key not in data:
            raise ProfileError(f"{where}: missing key {key!r}")

    def positive(key: str, value: object) -> float:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ProfileError(f"{where}: {key} must be a positive number, got {value!r}")
        return float(value)

    if data["kind"] not in ("cpu", "gpu"):
        raise ProfileError(f"{where}: kind must be 'cpu' or 'gpu', got {data['kind']!r}")
    flops = data["flops"]
    if not isinstance(flops, dict) or "float32" not in flops:
        raise ProfileError(f"{where}: flops must map dtypes ({', '.join(DTYPES)}) to FLOP/s, float32 at least")
    for dtype, value in flops.items():
        if dtype not in DTYPES:
            raise ProfileError(f"{where}: flops.{dtype}: unknown dtype; known: {', '.join(DTYPES)}")
        positive(f"flops.{dtype}", value)
    links = data["links"]
    if not isinstance(links, dict) or set(links) != set(LINK_CLASSES):
        raise ProfileError(f"{where}: links must give exactly {', '.join(LINK_CLASSES)}, got {sorted(links) if isinstance(links, dict) else links!r}")
    parsed_links = {}
    for cls, link in links.items():
        if not isinstance(link, dict) or set(link) != {"bandwidth", "latency"}:
            raise ProfileError(f"{where}: links.{cls} must be {{bandwidth: bytes/s, latency: s}}, got {link!r}")
        parsed_links[cls] = Link(bandwidth=positive(f"links.{cls}.bandwidth", link["bandwidth"]),
                                 latency=positive(f"links.{cls}.latency", link["latency"]))
    full = {d: float(flops.get(d, flops["float32"])) for d in DTYPES}
    devices = data["devices_per_node"]
    if isinstance(devices, bool) or not isinstance(devices, int) or devices < 1:
        raise ProfileError(f"{where}: devices_per_node must be an integer >= 1, got {devices!r}")
    cores = data.get("cores")
    if data["kind"] == "cpu" and (isinstance(cores, bool) or not isinstance(cores, int) or cores < 1):
        raise ProfileError(f"{where}: a cpu profile needs cores (an integer >= 1), got {cores!r}")
    efficiency = data.get("efficiency") or {}
    if not isinstance(efficiency, dict):
        raise ProfileError(f"{where}: efficiency must map operation classes ({', '.join(OP_CLASSES)}) to factors")
    for cls, value in efficiency.items():
        if cls not in OP_CLASSES:
            raise ProfileError(f"{where}: efficiency.{cls}: unknown operation class; known: {', '.join(OP_CLASSES)}")
        positive(f"efficiency.{cls}", value)
    return DeviceProfile(
        efficiency={k: float(v) for k, v in efficiency.items()},
        name=str(data["name"]), kind=data["kind"], memory_gib=positive("memory_gib", data["memory_gib"]),
        devices_per_node=devices, flops=full, memory_bandwidth=positive("memory_bandwidth", data["memory_bandwidth"]),
        op_overhead=positive("op_overhead", data["op_overhead"]), links=parsed_links, cores=cores, source=where,
    )
