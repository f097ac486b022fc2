"""ZeRO-2 across processes: 2 processes x 4 CPU devices on localhost, talking through
gloo, must compute what one process with 8 devices computes.

The test starts tests/multihost_worker.py twice with ``subprocess`` (a coordinator on a
free localhost port), waits with a timeout, and kills both on any failure.
"""

import os
import subprocess
import sys
import time
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from localhost import free_port, gloo_available

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:  # plain `pytest` rootdir imports (tests/ is on sys.path)
    import sharded_problem as sp

NUM_PROCESSES = 2
LOCAL_DEVICES = 4
STEPS = 3
TIMEOUT_S = 120
WORKER = Path(__file__).resolve().parent / "multihost_worker.py"
REPO = Path(__file__).resolve().parents[1]


def _worker_env():
    env = dict(os.environ)
    flags = [f for f in env.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env["XLA_FLAGS"] = " ".join(flags + [f"--xla_force_host_platform_device_count={LOCAL_DEVICES}"])
    env["JAX_PLATFORMS"] = "cpu"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env


def run_workers(out_dir, mode="zero2"):
    """Starts the processes and waits for all; returns their logs. Kills every child
    still running on a timeout or any error."""
    port = free_port()
    logs = [out_dir / f"worker_{i}.log" for i in range(NUM_PROCESSES)]
    procs = []
    try:
        for i in range(NUM_PROCESSES):
            with open(logs[i], "w") as log:
                procs.append(subprocess.Popen(
                    [sys.executable, str(WORKER), "--process-id", str(i),
                     "--num-processes", str(NUM_PROCESSES), "--port", str(port),
                     "--steps", str(STEPS), "--out", str(out_dir), "--mode", mode],
                    stdout=log, stderr=subprocess.STDOUT, env=_worker_env(), cwd=REPO))
        deadline = time.monotonic() + TIMEOUT_S
        while True:
            codes = [p.poll() for p in procs]
            if all(c is not None for c in codes):
                break
            if any(c not in (None, 0) for c in codes):
                break  # one failed: the others would wait for it until they time out
            if time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        for p in procs:
            p.wait()
    texts = [log.read_text() for log in logs]
    report = "\n".join(f"--- process {i} (exit {p.returncode}):\n{t[-3000:]}"
                       for i, (p, t) in enumerate(zip(procs, texts)))
    return [p.returncode for p in procs], report


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
@pytest.mark.skipif(jax.device_count() < NUM_PROCESSES * LOCAL_DEVICES,
                    reason="needs 8 devices in this process for the reference run")
def test_two_processes_match_one_process_with_eight_devices(tmp_path):
    codes, report = run_workers(tmp_path)
    assert codes == [0] * NUM_PROCESSES, f"workers failed or timed out ({TIMEOUT_S}s):\n{report}"
    results = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(NUM_PROCESSES)]

    # Every process ends with the same (replicated) params, bit for bit.
    for other in results[1:]:
        assert other.keys() == results[0].keys()
        for k in results[0]:
            np.testing.assert_array_equal(other[k], results[0][k], err_msg=k)

    # The same steps in this process, on a one-process mesh of 8 devices.
    n = NUM_PROCESSES * LOCAL_DEVICES
    _, init, step, _, _ = sp.sharded((n,))
    p0 = sp.make_params()
    params, state = p0, init(p0)
    for s in range(STEPS):
        params, state = step(params, state, sp.device_grads(s, range(n)))
    want = {muon_optax.path_str(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    start = {muon_optax.path_str(p): np.asarray(x)
             for p, x in jax.tree_util.tree_flatten_with_path(p0)[0]}
    assert results[0].keys() == want.keys()
    for k, w in want.items():
        # gloo may sum in another order than the in-process collectives: compare the
        # total change over the steps with a float tolerance.
        got = results[0][k].astype(np.float64)
        w, p = w.astype(np.float64), start[k].astype(np.float64)
        err = np.linalg.norm(got - w)
        allowed = 3e-5 * np.linalg.norm(w - p) + 1e-7 * np.linalg.norm(p)
        assert err <= allowed, f"{k}: {err:.2e} > {allowed:.2e}"


@pytest.mark.skipif(not gloo_available(), reason="this jaxlib has no gloo CPU collectives")
def test_two_processes_fsdp_match_one_device(tmp_path):
    """Params split over the 8 devices of 2 processes (mesh=, plain jit): the Muon
    matrices reach their owners across processes by all-to-all. Every device sees the
    mean gradient, so the run equals the one-device run."""
    codes, report = run_workers(tmp_path, mode="fsdp")
    assert codes == [0] * NUM_PROCESSES, f"workers failed or timed out ({TIMEOUT_S}s):\n{report}"
    results = [dict(np.load(tmp_path / f"params_{i}.npz")) for i in range(NUM_PROCESSES)]
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS)
    p0 = sp.make_params()
    params, state = p0, tx.init(p0)
    for s in range(STEPS):
        grads = sp.mean_grads(sp.device_grads(s, range(4)), np.float32)
        updates, state = jax.jit(tx.update)(grads, state, params)
        params = optax.apply_updates(params, updates)
    for path, w in jax.tree_util.tree_flatten_with_path(params)[0]:
        k = muon_optax.path_str(path)
        w, p = np.asarray(w, np.float64), np.asarray(
            dict(jax.tree_util.tree_flatten_with_path(p0)[0])[path], np.float64)
        for r in results:
            err = np.linalg.norm(r[k].astype(np.float64) - w)
            assert err <= 1e-5 * np.linalg.norm(w - p) + 1e-7 * np.linalg.norm(p), k
