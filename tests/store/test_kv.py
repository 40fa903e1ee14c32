"""The metadata store: specs (pure), CAS, atomic commits, concurrent writers across processes."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from nereus.store.errors import ConflictError, StoreError
from nereus.store.kv import ABSENT, MetaStore, plan_kvstore_spec, split_url


@pytest.mark.parametrize(
    "url, base",
    [
        ("/data/job", {"driver": "file", "path": "/data/job/meta/"}),
        ("file:///data/job/", {"driver": "file", "path": "/data/job/meta/"}),
        ("memory://job1", {"driver": "memory", "path": "job1/meta/"}),
        ("gs://bucket/runs/a", {"driver": "gcs", "bucket": "bucket", "path": "runs/a/meta/"}),
        ("s3://bucket/runs/a/", {"driver": "s3", "bucket": "bucket", "path": "runs/a/meta/"}),
        ("s3://bucket", {"driver": "s3", "bucket": "bucket", "path": "meta/"}),
    ],
)
def test_spec_is_ocdbt_over_the_url(url, base):
    assert plan_kvstore_spec(url) == {"driver": "ocdbt", "base": base}


def test_spec_rejects_unknown_schemes():
    with pytest.raises(StoreError, match="ftp"):
        plan_kvstore_spec("ftp://host/x")
    assert split_url("relative/dir") == ("file", "relative/dir")


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    url = str(tmp_path / "root") if request.param == "file" else f"memory://kv-{tmp_path.name}"
    return MetaStore.open(url)


def test_records_round_trip_and_reopen(store):
    store.put("a/x", {"schema": 1, "v": [1, 2]})
    assert store.get("a/x").value == {"schema": 1, "v": [1, 2]}
    assert store.get("missing") is None
    again = MetaStore.open(store.url)  # a memory:// URL reopens the same data in-process
    assert again.get("a/x").value["v"] == [1, 2]
    assert again.keys("a/") == ["a/x"] and again.keys("b/") == []


def test_create_only_write_loses_loudly(store):
    store.put("k", {"n": 1}, expect=ABSENT)
    with pytest.raises(ConflictError, match="'k' already exists"):
        store.put("k", {"n": 2}, expect=ABSENT)
    assert store.get("k").value == {"n": 1}


def test_compare_and_swap_detects_a_stale_read(store):
    store.put("k", {"n": 1})
    first = store.get("k")
    store.put("k", {"n": 2}, expect=first.generation)
    with pytest.raises(ConflictError, match="changed since it was read"):
        store.put("k", {"n": 3}, expect=first.generation)
    assert store.get("k").value == {"n": 2}


def test_the_generation_of_a_missing_key_is_what_a_create_only_write_expects(store):
    """ABSENT is what tensorstore itself reports for a missing key: a CAS made with it
    creates the key once, and is refused once the key exists (deleted, it is ABSENT again)."""
    missing = store.generation("nothing-here")
    assert missing == ABSENT
    first = store.put("nothing-here", {"n": 1}, expect=missing)
    assert first not in (ABSENT, b"") and store.generation("nothing-here") == first
    with pytest.raises(ConflictError, match="already exists"):
        store.put("nothing-here", {"n": 2}, expect=missing)
    second = store.put("nothing-here", {"n": 3}, expect=first)
    assert second != first and store.get("nothing-here").value == {"n": 3}
    store.put("nothing-here", None, expect=second)
    assert store.generation("nothing-here") == ABSENT and store.get("nothing-here") is None


def test_atomic_commit_all_or_nothing(store):
    store.put("k", {"n": 1})
    gen = store.get("k").generation
    store.put("k", {"n": 2})
    with pytest.raises(ConflictError):
        store.commit({"x": {"a": 1}, "k": {"n": 9}}, expect={"k": gen})
    assert store.get("x") is None and store.get("k").value == {"n": 2}
    store.commit({"x": {"a": 1}, "k": None}, expect={"k": store.generation("k")})
    assert store.get("x").value == {"a": 1} and store.get("k") is None


def _increment(url: str, times: int, queue) -> None:
    store = MetaStore.open(url)
    lost = 0
    done = 0
    while done < times:
        entry = store.get("counter")
        n = entry.value["n"] if entry else 0
        try:
            store.put("counter", {"n": n + 1}, expect=entry.generation if entry else ABSENT)
            done += 1
        except ConflictError:
            lost += 1
    queue.put(lost)


@pytest.mark.timeout(60)
def test_concurrent_writers_on_ocdbt_never_lose_an_update(tmp_path):
    """Three spawned processes increment one counter by CAS: no update is lost."""
    url = str(tmp_path / "root")
    MetaStore.open(url)
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_increment, args=(url, 20, queue)) for _ in range(3)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
        assert p.exitcode == 0
    [queue.get(timeout=5) for _ in procs]
    assert MetaStore.open(url).get("counter").value == {"n": 60}


# ------------------------------------------------------------------ job record and plans


def _record_plans(url: str, n: int, tag: int, queue) -> None:
    from nereus.reshard.derive import DecoderSpec, derive_emus
    from nereus.reshard.layout import ParallelConfig
    from nereus.store.job import record_plan

    store = MetaStore.open(url)
    spec = DecoderSpec(vocab_size=8, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=2, num_kv_heads=2)
    emus = derive_emus(spec, ParallelConfig.on(tp=2), model="actor", stage="train")
    queue.put([record_plan(store, emus, {"writer": tag}) for _ in range(n)])


@pytest.mark.timeout(60)
def test_plans_recorded_concurrently_get_distinct_indices(tmp_path):
    from nereus.store.job import read_job, record_job, record_transition
    from nereus.store.records import Transition, plan_emus, plan_key

    url = str(tmp_path / "root")
    record_job(MetaStore.open(url), {"lr": 1e-5})
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_record_plans, args=(url, 5, tag, queue)) for tag in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(50)
        assert p.exitcode == 0
    indices = sorted(i for _ in procs for i in queue.get(timeout=5))
    assert indices == list(range(10))
    store = MetaStore.open(url)
    job = record_transition(store, Transition(step=3, from_plan=0, to_plan=1, predicted_s=1.5, measured_s=1.7, nbytes=10))
    assert read_job(store) == job and sorted(job.plans) == indices and job.config == {"lr": 1e-5}
    assert plan_emus(plan_key(7), store.get(plan_key(7)).value)[0].config.tp == 2


def test_a_restart_keeps_the_history_up_to_its_step_and_a_fresh_run_starts_a_new_one(tmp_path):
    """``start_job``: a resume at step 4 drops the transitions after it (the steps it redoes)
    and the plans only they named, and takes the start's config; a second start at the same
    step drops the first one's own ``resume`` move; ``plan_index`` finds a plan by its config
    (put back in the history) before it records one; a fresh run empties the history, and its
    new plans are numbered past the earlier run's records (plans/<i> are create-only)."""
    from nereus.store.job import plan_config, plan_index, read_job, record_plan, record_transition, running_plan, start_job
    from nereus.store.records import Transition

    store = MetaStore.open(str(tmp_path / "root"))
    job = start_job(store, {"steps": 8}, step=0)
    assert job.plans == () and running_plan(job) is None
    plans = [plan_index(store, {"n": n}) for n in range(3)]
    assert plans == [0, 1, 2] and plan_index(store, {"n": 1}) == 1  # found, not recorded again
    for step, (a, b) in zip((2, 5), zip(plans, plans[1:])):
        record_transition(store, Transition(step=step, from_plan=a, to_plan=b, predicted_s=0.5, measured_s=0.7))
    assert running_plan(read_job(store)) == plans[2]

    resumed = start_job(store, {"steps": 12}, step=4)
    assert [t.step for t in resumed.transitions] == [2] and resumed.config == {"steps": 12}
    assert resumed.plans == (0, 1) and running_plan(resumed) == 1 and plan_config(store, 1) == {"n": 1}
    assert read_job(store) == resumed
    record_transition(store, Transition(step=4, from_plan=1, to_plan=plan_index(store, {"n": 7}), predicted_s=0.0, measured_s=2.0,
                                        mode="resume"))  # resumed on another world: plan 3
    again = start_job(store, {"steps": 12}, step=4)  # that run crashed before its next checkpoint: from step 4 again
    assert [(t.step, t.mode) for t in again.transitions] == [(2, "stream")] and running_plan(again) == 1
    assert plan_index(store, {"n": 2}) == 2 and read_job(store).plans == (0, 1, 2)  # the move after 5 again: into plan 2

    fresh = start_job(store, {"steps": 3}, step=0)
    assert fresh.plans == () and fresh.transitions == () and fresh.config == {"steps": 3}
    assert plan_index(store, {"n": 9}) == 4 and running_plan(read_job(store)) == 4
    assert record_plan(store, (), {"n": 10}) == 5
