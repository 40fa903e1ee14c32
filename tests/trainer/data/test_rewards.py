"""Rule rewards: the GSM8K and MATH rules, auto dispatch, verl's compute_score contract through the
spawned worker pool (float, dict, exception, timeout, bad returns, a dying worker, order), load errors.

The reward functions are real files under tests/trainer/data/reward_fns/. Two pools (on_error zero and
raise) are shared by the contract tests, so the file spawns few processes; timeouts are 1 s.
"""

from __future__ import annotations

import importlib.util
import math
import os
import sys
import time

import numpy as np
import pytest
import torch

from nereus.trainer.data import rewards
from nereus.trainer.config import RewardConfig
from nereus.trainer.data.rewards import (
    RewardError,
    RewardItem,
    RewardScorer,
    builtin_rule,
    check_rewards,
    gsm8k_score,
    load_reward_function,
)

pytestmark = pytest.mark.timeout(120)

FNS = os.path.relpath(os.path.join(os.path.dirname(__file__), "reward_fns"))
CONTRACT = f"{FNS}/contract.py:compute_score"
HAS_MATH_VERIFY = importlib.util.find_spec("math_verify") is not None
TIMEOUT_S = 1.0


def item(index, data_source, solution="", truth="", **extra):
    return RewardItem(index=index, data_source=data_source, solution_str=solution, ground_truth=truth, extra_info=extra)


@pytest.fixture(scope="module")
def zero_scorer():
    with RewardScorer(RewardConfig(function=CONTRACT, on_error="zero", timeout_s=TIMEOUT_S, workers=3)) as s:
        yield s


@pytest.fixture(scope="module")
def raise_scorer():
    with RewardScorer(RewardConfig(function=CONTRACT, on_error="raise", timeout_s=TIMEOUT_S, workers=2)) as s:
        yield s


# ---------------------------------------------------------------- GSM8K


@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("Natalia sold 48 + 24 = 72 clips.\n#### 72", "72", 1.0),  # strict
        ("#### 72\nThen I double-check: 3 more", "72", 1.0),  # strict wins over a later number
        ("3 + 4 = 7 #### 8", "7", 0.0),  # strict answer wrong: no fallback past it
        ("first #### 5 then #### 7", "7", 1.0),  # the last #### counts
        ("So she has 72 clips in total.", "72", 1.0),  # last-number fallback, trailing '.'
        ("The answer is $1,234.", "1234", 1.0),  # commas and $
        ("#### $1,234.00", "1,234", 1.0),  # decimals compared as numbers
        ("It costs $ 18 dollars", "18", 1.0),
        ("x = -3", "-3", 1.0),
        ("5-3 = 2", "2", 1.0),  # a minus between numbers is not a sign
        ("So the total is 71.", "72", 0.0),  # wrong answer
        ("I do not know.", "72", 0.0),  # no number
        ("", "72", 0.0),
        ("1,2,3 and so 3", "123", 0.0),  # '1,2,3' is not one thousands-grouped number
    ],
)
def test_gsm8k_rule(solution, truth, expected):
    assert gsm8k_score("openai/gsm8k", solution, truth, {}) == expected


def test_gsm8k_ground_truth_forms():
    assert gsm8k_score("gsm8k", "#### 72", "She sold 48/2 = 24.\n#### 72", None) == 1.0  # raw GSM8K answer
    assert gsm8k_score("gsm8k", "#### 72", 72, None) == 1.0  # a number
    with pytest.raises(ValueError, match="'seventy-two' is not a number"):
        gsm8k_score("gsm8k", "#### 72", "seventy-two", None)


def test_gsm8k_builtin_runs_in_process():
    with RewardScorer(RewardConfig(builtin="gsm8k")) as s:
        res = s.score([item(0, "anything", "#### 3", "3"), item(1, "anything", "4", "3")])
        assert not s._pools  # no worker pool for the pure rule
    assert res.scores == [1.0, 0.0] and res.errors == 0 and res.metrics == {}


def test_gsm8k_bad_ground_truth_is_an_error_not_a_zero():
    with RewardScorer(RewardConfig(builtin="gsm8k")) as s:
        with pytest.raises(RewardError, match=r"builtin gsm8k reward failed on sample 7 .*'nope' is not a number"):
            s.score([item(7, "openai/gsm8k", "#### 1", "nope")])
    with RewardScorer(RewardConfig(builtin="gsm8k", on_error="zero")) as s:
        res = s.score([item(0, "openai/gsm8k", "#### 1", "1"), item(7, "openai/gsm8k", "#### 1", "nope")])
    assert res.scores == [1.0, 0.0] and res.errors == 1 and "sample 7" in res.first_error


# ---------------------------------------------------------------- MATH


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify not installed (pip install math-verify)")
@pytest.mark.parametrize(
    "solution, truth, expected",
    [
        ("so the answer is \\boxed{0.5}", "\\frac{1}{2}", 1.0),
        ("The answer is $\\frac{\\sqrt3}{2}$.", "\\frac{\\sqrt{3}}{2}", 1.0),
        ("\\boxed{(3, -1)}", "(3,-1)", 1.0),
        ("\\boxed{1+x^2}", "x^2+1", 1.0),
        ("The answer is $6$.", "5", 0.0),
        ("no answer here", "5", 0.0),
        ("\\boxed{2}", "$2$", 1.0),  # a ground truth already in $...$
    ],
)
def test_math_rule(solution, truth, expected):
    assert rewards.math_score("lighteval/MATH", solution, truth, {}) == expected


def test_math_needs_math_verify(monkeypatch):
    monkeypatch.setattr(rewards.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RewardError, match=r"math-verify.*pip install math-verify.*nereus\[math\]"):
        RewardScorer(RewardConfig(builtin="math"))
    with pytest.raises(RewardError, match="pip install math-verify"):
        check_rewards(RewardConfig(), ["HuggingFaceH4/MATH-500"])
    monkeypatch.setitem(sys.modules, "math_verify", None)  # import fails
    with pytest.raises(RewardError, match="pip install math-verify"):
        rewards.math_score("math", "1", "1")


# ---------------------------------------------------------------- auto dispatch


@pytest.mark.parametrize(
    "source, rule",
    [
        ("openai/gsm8k", "gsm8k"),
        ("gsm8k", "gsm8k"),
        ("lighteval/MATH", "math"),
        ("DigitalLearningGmbH/MATH-lighteval", "math"),
        ("HuggingFaceH4/MATH-500", "math"),
        ("math", "math"),
        ("my_math_set", "math"),
    ],
)
def test_auto_rule(source, rule):
    assert builtin_rule(source) == rule


def test_auto_unknown_data_source():
    with pytest.raises(RewardError, match=r"data_source 'my/trivia'.*set reward.function"):
        builtin_rule("my/trivia")
    with pytest.raises(RewardError, match="'my/trivia'"):
        check_rewards(RewardConfig(), ["openai/gsm8k", "my/trivia"])
    check_rewards(RewardConfig(), ["openai/gsm8k"])
    check_rewards(RewardConfig(builtin="gsm8k"), ["my/trivia"])  # an explicit rule takes any source
    with RewardScorer(RewardConfig(on_error="zero")) as s:  # a config error: raised even under zero
        with pytest.raises(RewardError, match="'my/trivia'"):
            s.score([item(0, "openai/gsm8k", "#### 1", "1"), item(1, "my/trivia", "x", "y")])


@pytest.mark.skipif(not HAS_MATH_VERIFY, reason="math-verify not installed (pip install math-verify)")
def test_auto_mixed_sources_through_the_pool():
    batch = [
        item(0, "openai/gsm8k", "#### 4", "4"),
        item(1, "lighteval/MATH", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}"),
        item(2, "openai/gsm8k", "#### 5", "4"),
        item(3, "HuggingFaceH4/MATH-500", "\\boxed{3}", "2"),
    ]
    with RewardScorer(RewardConfig(workers=1, timeout_s=30)) as s:
        assert not s._pools  # started at the first MATH sample
        assert s.score(batch).scores == [1.0, 1.0, 0.0, 0.0]
        assert set(s._pools) == {"math"}


# ---------------------------------------------------------------- the contract, through the pool


def test_float_and_empty(zero_scorer):
    res = zero_scorer.score([item(0, "float", " 42 ", "42"), item(1, "float", "41", "42")])
    assert res.scores == [1.0, 0.0] and res.errors == 0 and res.first_error is None and res.metrics == {}
    assert zero_scorer.score([]).scores == []


def test_dict_score_and_metrics(zero_scorer):
    res = zero_scorer.score([item(0, "dict", "short"), item(1, "float", "1", "1"), item(2, "dict", "long")])
    assert res.scores == [0.5, 1.0, 0.5]
    assert list(res.metrics) == ["acc", "length"]  # 'pred' is a string: not a metric
    assert res.metrics["acc"][0] == 1.0 and math.isnan(res.metrics["acc"][1]) and res.metrics["acc"][2] == 1.0
    assert math.isnan(res.metrics["length"][0]) and math.isnan(res.metrics["length"][1])
    assert res.metrics["length"][2] == 4.0


def test_exception_zero(zero_scorer, caplog):
    res = zero_scorer.score([item(0, "float", "1", "1"), item(5, "raise", "x"), item(6, "raise", "y")])
    assert res.scores == [1.0, 0.0, 0.0] and res.errors == 2
    assert f"reward.function '{CONTRACT}' failed on sample 5 (data_source 'raise')" in res.first_error
    assert "raised ValueError: cannot grade 'x'" in res.first_error
    assert "2 of 3 reward calls failed" in caplog.text  # logged, never a silent zero


def test_exception_raise(raise_scorer):
    with pytest.raises(RewardError) as e:
        raise_scorer.score([item(0, "float", "1", "1"), item(5, "raise", "x")])
    msg = str(e.value)
    assert "\n" not in msg
    for part in ("sample 5", "data_source 'raise'", CONTRACT, "ValueError: cannot grade 'x'", "on_error: zero"):
        assert part in msg
    assert raise_scorer.score([item(0, "float", "1", "1")]).scores == [1.0]  # still works


@pytest.mark.parametrize(
    "value, why",
    [
        ("1.0", "returned str '1.0', not a finite number"),
        (None, "returned NoneType None"),
        (float("nan"), "returned float nan"),
        (float("inf"), "returned float inf"),
        ([1.0], "returned list [1.0]"),
        ({"acc": 1.0}, "returned a dict without a 'score' key (keys: acc)"),
        ({"score": "high"}, "'score' is str 'high', not a finite number"),
        ({"score": float("nan")}, "'score' is float nan"),
    ],
)
def test_non_number_is_an_error(zero_scorer, raise_scorer, value, why):
    res = zero_scorer.score([item(3, "bad", value=value)])
    assert res.scores == [0.0] and res.errors == 1 and why in res.first_error
    with pytest.raises(RewardError, match="sample 3"):
        raise_scorer.score([item(3, "bad", value=value)])


@pytest.mark.parametrize("value, score", [(True, 1.0), (2, 2.0), (np.float32(0.25), 0.25), (np.array(0.5), 0.5)])
def test_numeric_returns(zero_scorer, value, score):
    res = zero_scorer.score([item(0, "bad", value=value), item(1, "bad", value={"score": value, "m": value})])
    assert res.errors == 0 and res.scores == [score, score] and res.metrics["m"][1] == score


def test_tensor_returns():  # in-process: unpickling a tensor in a worker imports torch, slower than 1 s here
    assert rewards.normalize_result(torch.tensor(0.75)) == (0.75, {})
    assert rewards.normalize_result({"score": torch.tensor(1.0), "m": np.int64(2)}) == (1.0, {"m": 2.0})
    with pytest.raises(ValueError, match="returned Tensor"):
        rewards.normalize_result(torch.ones(2))


def test_timeout_zero_does_not_hang(zero_scorer):
    batch = [item(i, "index", i=i) for i in range(40)]
    batch[17] = item(17, "sleep", sleep_s=30)
    t0 = time.monotonic()
    res = zero_scorer.score(batch)
    elapsed = time.monotonic() - t0
    assert elapsed < TIMEOUT_S + 3, elapsed
    assert res.errors == 1 and f"sample 17 (data_source 'sleep'): timed out after {TIMEOUT_S:g} s" in res.first_error
    assert res.scores == [0.0 if i == 17 else float(i) for i in range(40)]  # the stuck chunk's rest rescored
    assert zero_scorer.score([item(0, "float", "1", "1")]).scores == [1.0]  # the next call works


def test_timeout_raise_does_not_hang(raise_scorer):
    t0 = time.monotonic()
    with pytest.raises(RewardError, match=rf"failed on sample 2 \(data_source 'sleep'\): timed out after {TIMEOUT_S:g} s"):
        raise_scorer.score([item(0, "float", "1", "1"), item(1, "float", "1", "1"), item(2, "sleep", sleep_s=30)])
    assert time.monotonic() - t0 < TIMEOUT_S + 3
    assert raise_scorer.score([item(i, "index", i=i) for i in range(8)]).scores == [float(i) for i in range(8)]


def test_dying_worker(zero_scorer):
    res = zero_scorer.score([item(0, "float", "1", "1"), item(1, "exit"), item(2, "float", "2", "2")])
    assert res.scores == [1.0, 0.0, 1.0] and res.errors == 1
    assert "sample 1 (data_source 'exit'): its worker process died (exit code 3)" in res.first_error
    assert zero_scorer.score([item(0, "float", "1", "1")]).scores == [1.0]


def test_order_over_many_items(zero_scorer):
    n = 700
    pids = [w.proc.pid for w in zero_scorer._pools["function"].workers]
    for _ in range(2):
        res = zero_scorer.score([item(i, "index", i=(i * 7919) % n) for i in range(n)])
        assert res.scores == [float((i * 7919) % n) for i in range(n)] and res.errors == 0
    assert [w.proc.pid for w in zero_scorer._pools["function"].workers] == pids  # one pool, reused


def test_worker_load_error_and_close():
    spec = f"{FNS}/worker_broken.py:compute_score"
    s = RewardScorer(RewardConfig(function=spec, workers=1))  # loads in this process
    procs = [w.proc for w in s._pools["function"].workers]
    for _ in range(2):  # the pool stays broken: the same error every time
        with pytest.raises(RewardError, match="could not load it: .*ImportError: only the trainer has this module"):
            s.score([item(0, "float", "1", "1")])
    s.close()
    assert not any(p.is_alive() for p in procs)


# ---------------------------------------------------------------- loading


def test_load_ok():
    fn = load_reward_function(f"{FNS}/contract.py:with_kwargs")  # **kwargs takes the four keywords
    assert fn(data_source="a", solution_str="b", ground_truth="c", extra_info={}) == 1.0
    assert load_reward_function("nereus.trainer.data.rewards:gsm8k_score") is gsm8k_score
    assert load_reward_function(f"{os.path.abspath(FNS)}/contract.py:trivial")(
        data_source="", solution_str="", ground_truth="", extra_info={}
    ) == 1.0


@pytest.mark.parametrize(
    "spec, why",
    [
        (f"{FNS}/missing.py:compute_score", "no such file"),
        ("nereus.trainer.no_such_module:f", "module 'nereus.trainer.no_such_module' is not importable: ModuleNotFoundError"),
        (f"{FNS}/contract.py:nope", "has no attribute 'nope' (callables there: compute_score"),
        (f"{FNS}/contract.py:NOT_CALLABLE", "'NOT_CALLABLE' is a int, not callable"),
        (f"{FNS}/contract.py:two_args", "cannot be called as compute_score(data_source=, solution_str="),
        (f"{FNS}/contract.py", "expected 'path/to/file.py:function' or 'package.module:function'"),
        (f"{FNS}/contract.py:", "expected 'path/to/file.py:function'"),
        (f"{FNS}/broken.py:compute_score", "raised RuntimeError: missing dependency: foo"),
    ],
)
def test_load_errors(spec, why):
    with pytest.raises(RewardError) as e:
        load_reward_function(spec)
    msg = str(e.value)
    assert msg.startswith(f"reward.function {spec!r}: ") and why in msg and "\n" not in msg, msg
    with pytest.raises(RewardError, match="reward.function"):  # the scorer checks before starting workers
        RewardScorer(RewardConfig(function=spec))
    with pytest.raises(RewardError, match="reward.function"):
        check_rewards(RewardConfig(function=spec))


def test_bad_pool_settings():
    with pytest.raises(RewardError, match="reward.workers"):
        RewardScorer(RewardConfig(function=CONTRACT, workers=0))
    with pytest.raises(RewardError, match="reward.timeout_s"):
        RewardScorer(RewardConfig(function=CONTRACT, timeout_s=0))
