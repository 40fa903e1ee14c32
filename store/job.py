"""The job record and plan history, updated by compare-and-swap.

``record_plan`` writes ``plans/<i>`` and appends ``i`` to the job record in ONE atomic
transaction conditioned on both keys, so two processes recording plans at once never
both take index ``i`` and never drop each other's entry: the loser re-reads and retries.
``record_transition`` appends to the job record the same way.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Mapping, Sequence

from nereus.reshard.layout import EMU

from .errors import ConflictError, StoreError
from .kv import ABSENT, MetaStore
from .records import JOB_KEY, PLAN_PREFIX, JobRecord, Transition, job_from_dict, job_to_dict, plan_key, plan_record

RETRIES = 50


def record_job(store: MetaStore, config: Mapping) -> JobRecord:
    """Create the job record with its resolved config, or return the existing one."""
    entry = store.get(JOB_KEY)
    if entry is not None:
        return job_from_dict(JOB_KEY, entry.value)
    job = JobRecord(config=dict(config))
    try:
        store.put(JOB_KEY, job_to_dict(job), expect=ABSENT)
    except ConflictError:
        return job_from_dict(JOB_KEY, store.get(JOB_KEY).value)
    return job


def start_job(store: MetaStore, config: Mapping, *, step: int) -> JobRecord:
    """A job (re)starting at ``step`` (0: a fresh run) with the resolved ``config``, in one
    compare-and-swap: a fresh run begins a new history; a resumed one keeps the transitions
    up to ``step`` (those after it belong to steps the resumed run does again, as
    ``metrics.jsonl`` is cut back, and so does an earlier resume at ``step``) and the plans
    they name, and takes ``config`` as the job's config."""
    record_job(store, config)  # created if absent

    def change(job: JobRecord) -> tuple[JobRecord, dict]:
        if step == 0:
            return JobRecord(config=dict(config)), {}
        # a move after step K ran before K's checkpoint was written; a resume at K is this start's to redo
        kept = tuple(t for t in job.transitions if t.step < step or (t.step == step and t.mode != "resume"))
        plans = tuple(dict.fromkeys([*job.plans[:1], *(t.to_plan for t in kept)]))  # the plans of the history kept
        return replace(job, config=dict(config), plans=plans, transitions=kept), {}

    return _update_job(store, change)


def running_plan(job: JobRecord) -> int | None:
    """The index of the plan the job ran last: the last transition's destination, else the
    history's first plan (every later plan is entered by a transition); None before any
    plan was recorded."""
    if job.transitions:
        return job.transitions[-1].to_plan
    return job.plans[0] if job.plans else None


def plan_config(store: MetaStore, index: int) -> dict:
    """The config a plan record was written with."""
    entry = store.get(plan_key(index))
    if entry is None:
        raise StoreError(f"{store.url}: no plan record {plan_key(index)!r}")
    return dict(entry.value.get("config", {}))


def read_job(store: MetaStore) -> JobRecord | None:
    """The job record; None before ``record_job``."""
    entry = store.get(JOB_KEY)
    return None if entry is None else job_from_dict(JOB_KEY, entry.value)


def _update_job(store: MetaStore, change: Callable[[JobRecord], tuple[JobRecord, dict]]) -> JobRecord:
    """Apply ``change`` (job -> (new job, extra create-only writes)) by CAS, retrying on conflict."""
    for _ in range(RETRIES):
        entry = store.get(JOB_KEY)
        if entry is None:
            raise StoreError(f"{store.url}: no job record; call record_job first")
        job, extra = change(job_from_dict(JOB_KEY, entry.value))
        expect = {JOB_KEY: entry.generation, **{key: ABSENT for key in extra}}
        try:
            store.commit({JOB_KEY: job_to_dict(job), **extra}, expect=expect)
            return job
        except ConflictError:
            continue
    raise ConflictError(f"{store.url}: job record kept changing; gave up after {RETRIES} attempts")


def record_plan(store: MetaStore, emus: Sequence[EMU], config: Mapping | None = None) -> int:
    """Store a plan's EMUs as ``plans/<i>`` and append ``i`` to the job's history; returns ``i``."""
    chosen: list[int] = []

    def change(job: JobRecord) -> tuple[JobRecord, dict]:
        # past every plan record there is, not only the history's: a fresh start's history is
        # empty while an earlier run's plans/ remain (create-only keys: never reused)
        index = max([*job.plans, *(int(k[len(PLAN_PREFIX):]) for k in store.keys(PLAN_PREFIX))], default=-1) + 1
        chosen[:] = [index]
        return replace(job, plans=job.plans + (index,)), {plan_key(index): plan_record(index, emus, config)}

    _update_job(store, change)
    return chosen[0]


def plan_index(store: MetaStore, config: Mapping, emus: Sequence[EMU] = ()) -> int:
    """The index of the plan record whose config is ``config`` (put back in the job's history
    if a cut-back history had dropped it), else a new record's (``record_plan``)."""
    for key in store.keys(PLAN_PREFIX):
        entry = store.get(key)
        if entry is not None and entry.value.get("config") == dict(config):
            index = int(key[len(PLAN_PREFIX):])
            _update_job(store, lambda job: (job if index in job.plans else replace(job, plans=job.plans + (index,)), {}))
            return index
    return record_plan(store, emus, config)


def record_transition(store: MetaStore, transition: Transition) -> JobRecord:
    """Append a transition (predicted and measured cost) to the job record."""
    return _update_job(store, lambda job: (replace(job, transitions=job.transitions + (transition,)), {}))
