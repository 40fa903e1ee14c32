"""A run's identity on a node: ``run_id`` (its run dir's path hashed: names the launchers'
semaphores, known before any worker starts) and ``staging_id`` (the path hashed with the run's
token, ``RUN_DIR/.nereus-run-token``: names its staging dir and seals its staged copies), and
the token itself, made by the run's first start and kept."""

from __future__ import annotations

import errno
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
    process's and hard-linked into place (``O_EXCL`` where the filesystem has no hard links),
    so that of processes starting together one token wins and every one reads it. Global rank
    0 asks, under the run dir's lock (a ``.tmp`` file of a maker on this host that is gone
    goes); the other ranks take its answer (``adopt_run_token``). OSError naming
    the file when it cannot be read or made, or holds no token."""
    token = _read_token(run_dir)
    if token is not None:
        return token
    os.makedirs(run_dir, exist_ok=True)
    path = os.path.join(run_dir, RUN_TOKEN)
    _remove_dead_tmp(run_dir)
    new = secrets.token_hex(TOKEN_BYTES) + "\n"
    tmp = f"{path}.{socket.gethostname()}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    with open(tmp, "w") as f:
        f.write(new)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:  # another process's won
        pass
    except OSError as e:
        if e.errno not in NO_LINKS:
            raise
        _write_exclusive(path, new)
    finally:
        os.unlink(tmp)
    token = _read_token(run_dir)
    if token is None:
        raise OSError(f"{path} is empty or was removed as this run started: remove it if it is there (the next start "
                      "makes a new run token; staged copies of this run are then not restored)")
    return token


def _remove_dead_tmp(run_dir: str) -> None:
    """Remove the ``.tmp`` files of token makers on this host that no longer run (SIGKILLed
    between their write and their unlink)."""
    from nereus.launch import pid_alive

    host = socket.gethostname()
    for name in os.listdir(run_dir):
        parts = name[len(RUN_TOKEN) + 1:].split(".") if name.startswith(RUN_TOKEN + ".") and name.endswith(".tmp") else []
        if len(parts) >= 4 and ".".join(parts[:-3]) == host and parts[-3].isdecimal() and not pid_alive(int(parts[-3])):
            try:
                os.unlink(os.path.join(run_dir, name))
            except FileNotFoundError:
                pass


TOKEN_BYTES = 16
NO_LINKS = (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK)  # link(2) refused by the filesystem


def _write_exclusive(path: str, text: str) -> None:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        return
    try:
        os.write(fd, text.encode())
        os.fsync(fd)
    finally:
        os.close(fd)


def has_token(run_dir: str) -> bool:
    """Whether a job started in ``run_dir`` already (its token is there, or adopted)."""
    return os.path.abspath(run_dir) in _TOKENS or _read_token(run_dir) is not None


def adopt_run_token(run_dir: str, token: str) -> None:
    """``token`` is the job's: every ``staging_id`` of ``run_dir`` in this process uses it."""
    _TOKENS[os.path.abspath(run_dir)] = token


def _read_token(run_dir: str) -> str | None:
    """The token in ``run_dir`` (None: no file, or an empty one); OSError naming the file
    when it cannot be read or is not a token (``TOKEN_BYTES`` hex digits)."""
    path = os.path.join(run_dir, RUN_TOKEN)
    try:
        with open(path) as f:
            text = f.read().strip()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except (OSError, UnicodeDecodeError) as e:
        raise OSError(f"cannot read the run token {path}: {e}") from None
    if text and (len(text) != 2 * TOKEN_BYTES or any(c not in "0123456789abcdef" for c in text)):
        raise OSError(f"{path} holds no run token ({2 * TOKEN_BYTES} hex digits): remove it (the next start makes a new "
                      "one; staged copies of this run are then not restored)")
    return text or None
