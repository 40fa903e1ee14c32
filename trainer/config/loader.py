"""The job config from YAML: YAML 1.2 scalars, ``--set`` overrides, the typed build (pure but the reads).

``build_tree(cls, mapping)`` builds a dataclass tree field by field from its annotations;
every error is a ``ConfigError`` naming the full dotted key:

    unknown key 'ppo.kl_coeff' (did you mean 'ppo.kl_coef'?)
    config key 'ppo.lr' expects float, got str 'fast'

``apply_overrides`` sets ``key.sub=value`` items (values parsed by the same YAML scalar
rules); ``config_to_dict`` is the inverse of the build (plain dicts, lists, scalars).
``trainer/prepare.py``'s ``load_config`` runs the whole path from a file to a runnable job.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any, Literal

import yaml

from .schema import ConfigError, JobConfig, PlanConfig


class YamlLoader(yaml.SafeLoader):
    """SafeLoader with YAML 1.2 floats (``1e-4``, ``5E3``), which PyYAML reads as strings."""


YamlLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float",
    re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."),
)


def _type_name(tp: object) -> str:
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def _coerce(value: object, tp: object, key: str) -> object:
    """``value`` as annotation ``tp``, or a ConfigError naming ``key``."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        (inner,) = [a for a in args if a is not type(None)]
        return _coerce(value, inner, key)
    if dataclasses.is_dataclass(tp):
        if not isinstance(value, Mapping):
            raise ConfigError(f"config key '{key}' expects a section ({tp.__name__}), got {type(value).__name__} {value!r}")
        return build_tree(tp, value, key + ".")
    if origin is Literal:
        if value not in args:
            close = difflib.get_close_matches(value, [a for a in args if isinstance(a, str)], n=1) if isinstance(value, str) else []
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise ConfigError(f"config key '{key}' must be one of {', '.join(map(repr, args))}; got {value!r}{hint}")
        return value
    if origin is tuple:
        if isinstance(value, str) and (args[0] is str or typing.get_origin(args[0]) is Literal):  # one for a list of one
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"config key '{key}' expects a list of {_type_name(args[0])}, got {type(value).__name__} {value!r}")
        return tuple(_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value))
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }.get(tp)  # type: ignore[call-overload]
    if ok is None:
        raise TypeError(f"config annotation {tp!r} of '{key}' is not supported")
    if not ok:
        raise ConfigError(f"config key '{key}' expects {_type_name(tp)}, got {type(value).__name__} {value!r}")
    return float(value) if tp is float else value


def build_tree(cls: type, data: Mapping, prefix: str = "") -> object:
    """A ``cls`` from a mapping; unknown keys are rejected with the closest valid key."""
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if key not in names:
            close = difflib.get_close_matches(str(key), names, n=1)
            hint = f" (did you mean '{prefix}{close[0]}'?)" if close else f"; valid keys: {', '.join(names)}"
            raise ConfigError(f"unknown key '{prefix}{key}'{hint}")
    kwargs = {k: _coerce(v, hints[k], prefix + k) for k, v in data.items()}
    required = [f.name for f in dataclasses.fields(cls) if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING]
    missing = [n for n in required if n not in kwargs]
    if missing:
        raise ConfigError(f"missing config key '{prefix}{missing[0]}'")
    return cls(**kwargs)


def apply_overrides(data: dict, overrides: Sequence[str]) -> dict:
    """A copy of ``data`` with each ``a.b.c=value`` set; values use YAML scalar rules."""
    data = copy.deepcopy(data)
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        try:
            value = yaml.load(text, Loader=YamlLoader)  # noqa: S506 - a SafeLoader subclass
        except yaml.YAMLError as e:
            raise ConfigError(f"override {item!r}: the value is not valid YAML ({e.problem})") from None
        parts = key.strip().split(".")
        node = data
        for i, part in enumerate(parts[:-1]):
            child = node.get(part)
            if child is None:
                child = node[part] = {}
            if not isinstance(child, dict):
                raise ConfigError(f"override {item!r}: '{'.'.join(parts[: i + 1])}' is a value, not a section")
            node = child
        node[parts[-1]] = value
    return data


def config_to_dict(cfg: JobConfig | PlanConfig) -> dict[str, Any]:
    """Plain dicts, lists and scalars (for YAML/JSON job records); ``load_config`` inverts it."""
    plain = _plain(cfg)
    assert isinstance(plain, dict)
    if isinstance(cfg, JobConfig) and cfg.data is not None:  # a dataset job has no toy task (giving both is an error)
        del plain["task"]
    return plain


def _plain(x: object) -> object:
    if dataclasses.is_dataclass(x) and not isinstance(x, type):
        return {f.name: _plain(getattr(x, f.name)) for f in dataclasses.fields(x)}
    if isinstance(x, (tuple, list)):
        return [_plain(v) for v in x]
    return x
