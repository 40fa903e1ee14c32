"""Small simulations for the tests: 64 MI250X GCDs, Llama-3.1-8B shapes, short traces (the big runs
are tools/bench_simulate.py's)."""

import pytest
from nereus.trainer.simulate.inputs import load_cluster, load_job
from nereus.trainer.simulate.traces import generate, load_trace_spec

CLUSTER = {"name": "test-64", "device": "mi250x", "nodes": 8}
JOB = {"name": "test-8b", "model": "llama-3.1-8b", "prompts_per_step": 128, "samples_per_prompt": 4, "minibatch_size": 256,
       "prompt": {"mean": 512, "max": 1024}, "response": {"max": 8192}}


@pytest.fixture(scope="session")
def small():
    cluster, job = load_cluster(CLUSTER), load_job(JOB)
    spec = load_trace_spec({"name": "drift-24", "steps": 24, "lengths": {"kind": "drift", "start": 500, "end": 4000}})
    trace = generate(spec, rows=job.rows, cap=job.response.max, devices=cluster.devices, per_node=cluster.per_node)
    return cluster, job, trace


@pytest.fixture(scope="session")
def small_result(small, tmp_path_factory):
    from nereus.trainer.simulate.run import simulate

    cluster, job, trace = small
    run_dir = tmp_path_factory.mktemp("sim")
    policies = ("best_static", "initial_fixed", "oracle", "greedy", "adaptive", "controller_greedy")
    return simulate(cluster, job, trace, trace_name="drift-24", run_dir=str(run_dir), policies=policies), run_dir
