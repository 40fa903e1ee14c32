"""A run's identity on a node: ``run_id`` (its run dir's path hashed: names the launchers'
semaphores, known before any worker starts) and ``staging_id`` (the path hashed with the run's
token, ``RUN_DIR/.nereus-run-token``: names its staging dir and seals its staged copies), and
the token itself, made by the run's first start and kept."""

from __future__ import annotations

import hashlib
import os
import secrets
import socket


def run_id(run_dir: str) -> str:
    """A run dir's identity on the node: a hash of its absolute path (the same on every node
    and every attempt), which names its launchers' semaphores. Its staged copies live and are
    sealed under ``staging_id``."""
    return hashlib.sha256(os.path.abspath(run_dir).encode()).hexdigest()[:12]


RUN_TOKEN = ".nereus-run-token"
"""A random token in RUN_DIR, made by the run's first start (``run_token``) and kept."""
_TOKENS: dict[str, str] = {}  # run dir (absolute) -> the job's token, as ``restore.agree_start`` broadcast it


def staging_id(run_dir: str) -> str:
    """The key this run's staged copies live (``nereus-<id>``) and are sealed under: the run
    dir's path hashed with the run's token — the job's (``adopt_run_token``), else the run
    dir's file — so that a run dir at the same path that is not this one (two containers
    sharing the host's ``/dev/shm``, each with its own volume at one path) never meets this
    run's copies. Without a token (no job started in the run dir yet): ``run_id``."""
    path = os.path.abspath(run_dir)
    token = _TOKENS.get(path) or _read_token(path)
    return run_id(path) if token is None else hashlib.sha256(f"{path}\n{token}".encode()).hexdigest()[:12]


def run_token(run_dir: str) -> str:
    """The run's token, made if the run dir has none: written whole to a file of this
    process's and hard-linked into place, so that of processes starting together one token
    wins and every one reads it. Global rank 0 asks, under the run dir's lock; the other ranks
    take its answer (``adopt_run_token``), whether or not their node sees the same run dir."""
    token = _read_token(run_dir)
    if token is not None:
        return token
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RUN_TOKEN)
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "w") as f:
        f.write(secrets.token_hex(16) + "\n")
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:  # another process's won
        pass
    finally:
        os.unlink(tmp)
    token = _read_token(run_dir)
    if token is None:
        raise OSError(f"{path} is empty: remove it (the next start makes a new run token; staged copies of this run are then not restored)")
    return token


def adopt_run_token(run_dir: str, token: str) -> None:
    """``token`` is the job's: every ``staging_id`` of ``run_dir`` in this process uses it."""
    _TOKENS[os.path.abspath(run_dir)] = token


def _read_token(run_dir: str) -> str | None:
    try:
        with open(os.path.join(run_dir, RUN_TOKEN)) as f:
            return f.read().strip() or None
    except (FileNotFoundError, NotADirectoryError):
        return None
