"""Rule rewards of a dataset job: verl's ``compute_score`` contract, built-in GSM8K and MATH rules.

The contract (verl's, unchanged, so a verl reward file moves over as it is)::

    compute_score(data_source=..., solution_str=..., ground_truth=..., extra_info=...) -> float | dict

called by keyword, as verl's ``NaiveRewardManager`` calls it, once per sample: ``solution_str`` is the
decoded response, ``ground_truth`` the row's ``reward_model.ground_truth``, ``extra_info`` its
``extra_info``. The return is a finite number (``bool``, numpy and 0-d tensor scalars count) or a dict
with a numeric ``score`` whose other numeric keys are metrics (``RewardResult.metrics``, NaN for
samples whose result lacked the key; non-numeric keys are ignored).

``reward.function`` names the function: ``path/to/file.py:name`` (loaded from the file by importlib,
the path relative to the current directory) or ``package.module:name``. ``load_reward_function`` checks
it before any step: a missing file, an unimportable module, a missing or non-callable name, or a
signature that cannot take the four keywords is a one-line ``RewardError`` naming the spec.
Without a function, ``reward.builtin`` picks a rule: ``gsm8k`` (the number after ``#### ``, else the
last number of the response; commas, ``$`` and a trailing ``.`` dropped, compared as decimals: 1.0 or
0.0), ``math`` (equivalence by ``math_verify.parse`` + ``verify``; the optional extra ``nereus[math]``)
or ``auto``: by each row's ``data_source`` (``builtin_rule``), any other source is an error telling to
set ``reward.function``.

Process model. User functions and the math rule run in ``reward.workers`` processes started with the
*spawn* method (the trainer has tensorstore loaded, which aborts in forked children), once per
``RewardScorer`` and reused by every step; each loads the function itself. A step's samples go out in
chunks (about four per worker, so a slow sample does not hold the rest back) and come back one
message per sample, so the parent knows which call is running and since when. The GSM8K rule is pure
and runs in the trainer process. As with any spawn, each worker imports the trainer's ``__main__``
module again (as ``__mp_main__``): entry scripts keep their work under ``if __name__ == "__main__"``.

Errors. A call that raises, returns something that is not a finite number (or a dict without a
numeric ``score``), kills its worker, or does not return within ``reward.timeout_s`` (measured by the
parent from the previous result of that worker: never early, late by at most the parent's own
delay) fails. A timed-out or dead worker is killed and replaced at once, its chunk's remaining samples
go to the others. ``on_error: raise`` stops at the first failure with a ``RewardError`` such as::

    reward.function 'rewards/fn.py:compute_score' failed on sample 3 (data_source 'openai/gsm8k'):
    timed out after 30 s (set reward.on_error: zero to score failed samples 0 and count them)

``on_error: zero`` scores the sample 0, counts it in ``RewardResult.errors`` and keeps the first
description for the log (and a warning): never a silent zero. Each sample that hangs costs up to
``timeout_s`` of one worker.
"""

from __future__ import annotations

import collections
import decimal
import importlib
import importlib.util
import inspect
import logging
import math
import multiprocessing
import multiprocessing.connection
import numbers
import os
import re
import signal
import sys
import time
import weakref
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the config module imports the planner; workers stay light without it
    from nereus.trainer.config import RewardConfig

log = logging.getLogger(__name__)

_KEYWORDS = ("data_source", "solution_str", "ground_truth", "extra_info")
_MATH_INSTALL = "pip install math-verify (or the extra: pip install 'nereus[math]')"
_START_TIMEOUT_S = 120.0  # spawn + imports + loading the user's module
_MAX_CHUNK = 64


class RewardError(RuntimeError):
    """A reward function that cannot be loaded, or a call that failed under ``on_error: raise``."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardItem:
    index: int  # the sample's index in the step's batch, for errors
    data_source: str
    solution_str: str  # the decoded response
    ground_truth: Any
    extra_info: dict = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True, slots=True)
class RewardResult:
    scores: list[float]  # one per item, in order; 0.0 for failed calls under on_error: zero
    metrics: dict[str, list[float]]  # a result dict's other numeric keys; NaN where an item lacked one
    errors: int = 0  # failed or timed-out calls, zeroed under on_error: zero
    first_error: str | None = None  # the first failure's description, for the log


# ---------------------------------------------------------------- built-in rules

_NUM = r"(?:(?<![\w)])-)?\$?\s?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?"
_NUMBER_RE = re.compile(_NUM)
_STRICT_RE = re.compile(r"####\s*(" + _NUM + ")")
_GSM8K_SOURCES = ("openai/gsm8k", "gsm8k")
_MATH_SOURCES = ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500", "math")


def _decimal(text: str) -> decimal.Decimal | None:
    text = re.sub(r"[\s$,]", "", text).rstrip(".")
    try:
        value = decimal.Decimal(text)
    except decimal.InvalidOperation:
        return None
    return value if value.is_finite() else None


def gsm8k_answer(solution_str: str) -> str | None:
    """The response's answer: the last ``#### <number>`` (verl's strict rule), else its last number."""
    strict = _STRICT_RE.findall(solution_str)
    if strict:
        return strict[-1]
    numbers_ = _NUMBER_RE.findall(solution_str)
    return numbers_[-1] if numbers_ else None


def gsm8k_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when the response's answer (``gsm8k_answer``) equals the ground truth as a decimal, else 0.0.

    A ground truth in GSM8K's raw form (``"... #### 72"``) is read after its ``####``; one that is
    not a number raises (a data error, not a zero).
    """
    truth = str(ground_truth)
    if "####" in truth:
        truth = truth.rsplit("####", 1)[1]
    expected = _decimal(truth)
    if expected is None:
        raise ValueError(f"gsm8k ground truth {truth.strip()[:40]!r} is not a number")
    answer = gsm8k_answer(solution_str)
    return 1.0 if answer is not None and _decimal(answer) == expected else 0.0


def math_score(data_source: str, solution_str: str, ground_truth: Any, extra_info: Any = None) -> float:
    """1.0 when math_verify finds the response's answer equivalent to the ground truth, else 0.0.

    A ground truth without ``$`` or ``\\boxed`` is read as ``\\boxed{ground_truth}`` (MATH's
    answers are bare LaTeX); the response is parsed with math_verify's defaults (LaTeX, boxed first,
    then plain expressions). A ground truth math_verify cannot parse raises.
    """
    try:
        from math_verify import parse, verify
    except ImportError as e:
        raise RewardError(f"the math reward needs math-verify ({e}): {_MATH_INSTALL}") from None
    truth = str(ground_truth)
    gold = parse(truth if ("$" in truth or "\\boxed" in truth) else "\\boxed{" + truth + "}")
    if not gold:
        raise ValueError(f"math_verify cannot parse the ground truth {truth[:60]!r}")
    return 1.0 if verify(gold, parse(solution_str)) else 0.0


def builtin_rule(data_source: str) -> str:
    """``reward.builtin: auto``'s rule for a data_source: ``"gsm8k"`` or ``"math"``, else ``RewardError``."""
    name = str(data_source).lower()
    if name in _GSM8K_SOURCES or "gsm8k" in name:
        return "gsm8k"
    if name in {s.lower() for s in _MATH_SOURCES} or "math" in name:
        return "math"
    raise RewardError(
        f"reward.builtin: auto has no rule for data_source {data_source!r} (gsm8k: {', '.join(_GSM8K_SOURCES)}; "
        f"math: {', '.join(_MATH_SOURCES)} or a name containing 'math'); set reward.function: "
        "path/to/file.py:compute_score"
    )


def _require_math_verify() -> None:
    if importlib.util.find_spec("math_verify") is None:
        raise RewardError(f"reward.builtin 'math' needs the math-verify package: {_MATH_INSTALL}")


_MATH_SPEC = f"{__name__}:math_score"


# ---------------------------------------------------------------- loading a user function

_file_modules: dict[tuple[str, int], Any] = {}


def _one_line(text: str, limit: int = 300) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _split_spec(spec: str) -> tuple[str, str]:
    target, sep, name = str(spec).rpartition(":")
    if not sep or not target or not name:
        raise RewardError(
            f"reward.function {spec!r}: expected 'path/to/file.py:function' or 'package.module:function'"
        )
    return target, name


def _is_file_spec(target: str) -> bool:
    return target.endswith(".py") or "/" in target or os.sep in target


def resolve_spec(spec: str) -> str:
    """The spec with a file path made absolute (workers load the same file whatever their cwd)."""
    target, name = _split_spec(spec)
    return f"{os.path.abspath(target)}:{name}" if _is_file_spec(target) else spec


def _import_file(spec: str, path: str) -> Any:
    if not os.path.isfile(path):
        raise RewardError(f"reward.function {spec!r}: no such file {path!r} (relative to {os.getcwd()!r})")
    path = os.path.abspath(path)
    key = (path, os.stat(path).st_mtime_ns)
    if key in _file_modules:
        return _file_modules[key]
    stem = re.sub(r"\W", "_", os.path.splitext(os.path.basename(path))[0])
    mod_name = f"nereus_reward_fn_{stem}_{abs(hash(path)) % 10**8}"
    mod_spec = importlib.util.spec_from_file_location(mod_name, path)
    if mod_spec is None or mod_spec.loader is None:
        raise RewardError(f"reward.function {spec!r}: {path!r} cannot be loaded as a Python module")
    module = importlib.util.module_from_spec(mod_spec)
    sys.modules[mod_name] = module  # before exec: dataclasses and pickling inside the file look it up
    try:
        mod_spec.loader.exec_module(module)
    except BaseException as e:  # noqa: BLE001 - a user's file: anything it raises is a load error
        sys.modules.pop(mod_name, None)
        raise RewardError(f"reward.function {spec!r}: loading {path!r} raised {_one_line(f'{type(e).__name__}: {e}')}") from None
    _file_modules[key] = module
    return module


def load_reward_function(spec: str) -> Callable[..., Any]:
    """Load and check ``"path/to/file.py:name"`` or ``"package.module:name"``; call it before any step.

    Raises a one-line ``RewardError`` naming the spec when the file or module is missing or fails to
    import, the name is missing or not callable, or its signature cannot be called with verl's four
    keywords (``**kwargs`` and extra parameters with defaults are fine; async functions are not).
    """
    target, name = _split_spec(spec)
    if _is_file_spec(target):
        module = _import_file(spec, target)
    else:
        try:
            module = importlib.import_module(target)
        except BaseException as e:  # noqa: BLE001
            raise RewardError(
                f"reward.function {spec!r}: module {target!r} is not importable: {_one_line(f'{type(e).__name__}: {e}')}"
            ) from None
    fn: Any = module
    for part in name.split("."):
        if not hasattr(fn, part):
            available = sorted(n for n, v in vars(module).items() if callable(v) and not n.startswith("_"))[:8]
            raise RewardError(
                f"reward.function {spec!r}: {target!r} has no attribute {name!r} (callables there: {', '.join(available) or 'none'})"
            )
        fn = getattr(fn, part)
    if not callable(fn):
        raise RewardError(f"reward.function {spec!r}: {name!r} is a {type(fn).__name__}, not callable")
    if inspect.iscoroutinefunction(fn):
        raise RewardError(f"reward.function {spec!r}: {name!r} is async; give a plain function")
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):  # builtins without a signature: checked by the first call instead
        return fn
    try:
        sig.bind(**{k: None for k in _KEYWORDS})
    except TypeError as e:
        raise RewardError(
            f"reward.function {spec!r}: {name}{sig} cannot be called as compute_score(data_source=, "
            f"solution_str=, ground_truth=, extra_info=): {e}"
        ) from None
    return fn


# ---------------------------------------------------------------- results

def _short(value: Any) -> str:
    text = repr(value)
    return f"{type(value).__name__} {text if len(text) <= 80 else text[:77] + '...'}"


def _number(value: Any) -> float | None:
    if not isinstance(value, numbers.Real) and callable(getattr(value, "item", None)):
        try:
            value = value.item()  # numpy scalars and 0-d arrays, 0-d tensors
        except (TypeError, ValueError, RuntimeError):
            return None
    return float(value) if isinstance(value, numbers.Real) else None


def normalize_result(value: Any) -> tuple[float, dict[str, float]]:
    """``(score, metrics)`` of one call's return; ``ValueError`` naming what was returned otherwise."""
    if isinstance(value, Mapping):
        if "score" not in value:
            keys = ", ".join(sorted(map(str, value))[:8])
            raise ValueError(f"returned a dict without a 'score' key (keys: {keys or 'none'})")
        score = _number(value["score"])
        if score is None or not math.isfinite(score):
            raise ValueError(f"returned a dict whose 'score' is {_short(value['score'])}, not a finite number")
        metrics = {}
        for key, v in value.items():
            if key != "score" and (f := _number(v)) is not None:
                metrics[str(key)] = f
        return score, metrics
    score = _number(value)
    if score is None or not math.isfinite(score):
        raise ValueError(f"returned {_short(value)}, not a finite number or a dict with a numeric 'score'")
    return score, {}


def _call(fn: Callable[..., Any], payload: tuple) -> tuple:
    """One call as verl makes it: ``("ok", score, metrics)`` or ``("err", description)``."""
    data_source, solution_str, ground_truth, extra_info = payload
    try:
        value = fn(data_source=data_source, solution_str=solution_str, ground_truth=ground_truth, extra_info=extra_info)
    except BaseException as e:  # noqa: BLE001 - SystemExit from user code is a failed call too
        return ("err", _one_line(f"raised {type(e).__name__}: {e}"))
    try:
        return ("ok", *normalize_result(value))
    except ValueError as e:
        return ("err", str(e))


# ---------------------------------------------------------------- the worker pool

def _worker_main(conn: multiprocessing.connection.Connection, spec: str) -> None:
    """A pool process: load the function, answer ``ready``, then one ``res`` message per sample."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; it closes the pool
    try:
        fn = load_reward_function(spec)
        if spec == _MATH_SPEC:
            fn(data_source="math", solution_str="$1$", ground_truth="1", extra_info={})  # import + warm sympy
    except BaseException as e:  # noqa: BLE001
        conn.send(("load_error", _one_line(str(e) if isinstance(e, RewardError) else f"{type(e).__name__}: {e}")))
        return
    conn.send(("ready", os.getpid()))
    while True:
        try:
            chunk = conn.recv()
        except (EOFError, OSError):
            return
        if chunk is None:
            return
        for pos, payload in chunk:
            conn.send(("res", pos, _call(fn, payload)))


@dataclass(eq=False)
class _Worker:
    proc: Any
    conn: multiprocessing.connection.Connection
    started: float
    ready: bool = False
    chunk: collections.deque = field(default_factory=collections.deque)  # positions sent, not answered
    item_start: float = 0.0  # when the call at chunk[0] began, as the parent knows it


def _stop(workers: list[_Worker], grace_s: float = 1.0) -> None:
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + grace_s
    for w in workers:
        w.proc.join(max(0.0, deadline - time.monotonic()))
        if w.proc.is_alive():
            w.proc.kill()
            w.proc.join(1.0)
        w.conn.close()


class _Pool:
    """``n`` spawned workers running one function with a per-call timeout (see the module docstring)."""

    def __init__(self, spec: str, n: int, timeout_s: float, name: str):
        self.spec, self.timeout_s, self.name = spec, timeout_s, name
        self.broken: str | None = None  # a worker's load error: every later run raises it
        self.ctx = multiprocessing.get_context("spawn")
        self.workers = [self._spawn() for _ in range(n)]
        self._finalizer = weakref.finalize(self, _stop, self.workers)

    def _spawn(self) -> _Worker:
        parent, child = self.ctx.Pipe(duplex=True)
        proc = self.ctx.Process(target=_worker_main, args=(child, self.spec), daemon=True, name="nereus-reward")
        proc.start()
        child.close()
        return _Worker(proc, parent, time.monotonic())

    def _replace(self, w: _Worker) -> None:
        w.proc.kill()
        w.proc.join(1.0)
        w.conn.close()
        self.workers[self.workers.index(w)] = self._spawn()

    def close(self) -> None:
        self._finalizer()

    def run(self, payloads: list[tuple], stop_on_error: bool) -> list[tuple | None]:
        """Each payload's outcome, in order; with ``stop_on_error`` it returns at the first failure."""
        if self.broken:
            raise RewardError(self.broken)
        n = len(payloads)
        out: list[tuple | None] = [None] * n
        size = max(1, min(_MAX_CHUNK, -(-n // (4 * len(self.workers)))))
        todo = collections.deque(collections.deque(range(s, min(s + size, n))) for s in range(0, n, size))
        try:
            while todo or any(w.chunk for w in self.workers):
                for w in list(self.workers):
                    if w.ready and not w.chunk and todo:
                        w.chunk = todo.popleft()
                        try:
                            w.conn.send([(i, payloads[i]) for i in w.chunk])
                        except OSError:  # died while idle: not the samples' fault
                            todo.appendleft(w.chunk)
                            w.chunk = collections.deque()
                            self._replace(w)
                            continue
                        w.item_start = time.monotonic()
                if self._step(out, todo) and stop_on_error:
                    break
        finally:  # an abandoned chunk would answer into the next call: replace busy workers
            for w in list(self.workers):
                if w.chunk:
                    self._replace(w)
        return out

    def _step(self, out: list, todo: collections.deque) -> bool:
        """Wait for messages or the nearest deadline once; True when a call failed."""
        deadlines = [w.item_start + self.timeout_s if w.chunk else w.started + _START_TIMEOUT_S
                     for w in self.workers if w.chunk or not w.ready]
        wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else None
        multiprocessing.connection.wait([w.conn for w in self.workers], wait_s)
        failed = False
        for w in list(self.workers):
            try:
                while w.conn.poll():
                    msg = w.conn.recv()
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "load_error":
                        self.broken = f"{self.name}: a reward worker could not load it: {msg[1]}"
                        raise RewardError(self.broken)
                    else:
                        pos = w.chunk.popleft()
                        out[pos] = msg[2]
                        failed |= msg[2][0] == "err"
                        w.item_start = time.monotonic()
            except (EOFError, OSError):
                w.proc.join(1.0)
                if not w.ready:
                    raise RewardError(f"{self.name}: a reward worker exited on start (exit code {w.proc.exitcode})") from None
                failed |= self._fail(w, f"its worker process died (exit code {w.proc.exitcode})", out, todo)
        now = time.monotonic()
        for w in list(self.workers):
            if w.chunk and now >= w.item_start + self.timeout_s:
                failed |= self._fail(w, f"timed out after {self.timeout_s:g} s", out, todo)
            elif not w.ready and now >= w.started + _START_TIMEOUT_S:
                raise RewardError(f"{self.name}: a reward worker did not start within {_START_TIMEOUT_S:g} s")
        return failed

    def _fail(self, w: _Worker, why: str, out: list, todo: collections.deque) -> bool:
        if not w.chunk:  # an idle worker died: replace it, nothing lost
            self._replace(w)
            return False
        out[w.chunk.popleft()] = ("err", why)
        if w.chunk:
            todo.appendleft(w.chunk)
        w.chunk = collections.deque()
        self._replace(w)
        return True


# ---------------------------------------------------------------- the scorer

class RewardScorer:
    """Scores a step's samples with ``cfg``'s function or built-in rule; holds the worker pool.

    ``score(items)`` may be called any number of times (the pool is started once: at construction for
    a function or ``builtin: math``, at the first MATH sample for ``auto``); ``close()`` or a ``with``
    block stops the workers.
    """

    def __init__(self, cfg: RewardConfig):
        if cfg.workers < 1:
            raise RewardError(f"reward.workers must be at least 1, got {cfg.workers}")
        if not cfg.timeout_s > 0:
            raise RewardError(f"reward.timeout_s must be positive, got {cfg.timeout_s}")
        self.cfg = cfg
        self._pools: dict[str, _Pool] = {}
        if cfg.function:
            load_reward_function(cfg.function)  # fail here, in the trainer, with the spec named
            self._pool("function")
        elif cfg.builtin == "math":
            _require_math_verify()
            self._pool("math")

    def _name(self, route: str) -> str:
        return f"reward.function {self.cfg.function!r}" if route == "function" else f"the builtin {route} reward"

    def _pool(self, route: str) -> _Pool:
        if route not in self._pools:
            if route == "math":
                _require_math_verify()
            spec = resolve_spec(self.cfg.function) if route == "function" else _MATH_SPEC
            self._pools[route] = _Pool(spec, self.cfg.workers, self.cfg.timeout_s, self._name(route))
        return self._pools[route]

    def _route(self, item: RewardItem) -> str:
        if self.cfg.function:
            return "function"
        return builtin_rule(item.data_source) if self.cfg.builtin == "auto" else self.cfg.builtin

    def score(self, items: list[RewardItem]) -> RewardResult:
        """One score per item, in order; raises ``RewardError`` under ``on_error: raise`` (see the module)."""
        stop = self.cfg.on_error == "raise"
        routes = [self._route(it) for it in items]  # an unknown data_source fails before any call
        outcomes: list[tuple | None] = [None] * len(items)
        for route in dict.fromkeys(routes):
            positions = [i for i, r in enumerate(routes) if r == route]
            payloads = [(items[i].data_source, items[i].solution_str, items[i].ground_truth, items[i].extra_info)
                        for i in positions]
            if route == "gsm8k":
                results = [_call(gsm8k_score, p) for p in payloads]
            else:
                results = self._pool(route).run(payloads, stop_on_error=stop)
            for i, res in zip(positions, results):
                outcomes[i] = res
                if stop and res is not None and res[0] == "err":
                    raise RewardError(
                        f"{self._describe(items[i], route, res[1])} (set reward.on_error: zero to score failed "
                        "samples 0 and count them)"
                    )
        return self._collect(items, routes, outcomes)

    def _describe(self, item: RewardItem, route: str, why: str) -> str:
        return f"{self._name(route)} failed on sample {item.index} (data_source {item.data_source!r}): {why}"

    def _collect(self, items: list[RewardItem], routes: list[str], outcomes: list) -> RewardResult:
        scores: list[float] = []
        metrics: dict[str, list[float]] = {}
        errors, first = 0, None
        for k, (item, route, res) in enumerate(zip(items, routes, outcomes)):
            if res[0] == "err":
                errors += 1
                first = first or self._describe(item, route, res[1])
                scores.append(0.0)
            else:
                scores.append(res[1])
                for key, value in res[2].items():
                    metrics.setdefault(key, [math.nan] * k).append(value)
            for column in metrics.values():  # keys this item's result lacked
                if len(column) == k:
                    column.append(math.nan)
        if errors:
            log.warning("%d of %d reward calls failed and scored 0; first: %s", errors, len(items), first)
        return RewardResult(scores=scores, metrics=metrics, errors=errors, first_error=first)

    def close(self) -> None:
        for pool in self._pools.values():
            pool.close()
        self._pools.clear()

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_rewards(cfg: RewardConfig, data_sources: Iterable[str] = ()) -> None:
    """Up-front checks for job start (before any step): the function loads, or every data_source has
    a built-in rule and the math rule's package is installed. Raises ``RewardError``."""
    if cfg.function:
        load_reward_function(cfg.function)
        return
    rules = {builtin_rule(s) for s in dict.fromkeys(data_sources)} if cfg.builtin == "auto" else {cfg.builtin}
    if "math" in rules:
        _require_math_verify()
