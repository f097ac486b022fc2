"""The benchmarks' shared helpers, and that each kept benchmark script runs (--quick)."""

import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from benchmarks import common  # noqa: E402


def _compiled_hlo(n: int) -> str:
    """A shard_map over n devices with one reduce-scatter (f32 (64, 16) operand), one
    all-gather (f32 (3, 5) per device -> (3n, 5)) and one all-reduce (f32 (7,)). (XLA:CPU
    sends bf16 collectives as f32, so the dtypes are checked on hand-written HLO below.)"""
    mesh = jax.make_mesh((n,), ("d",), axis_types=(AxisType.Auto,), devices=jax.devices()[:n])

    def body(x, y, z):
        return (jax.lax.psum_scatter(x, "d", scatter_dimension=0, tiled=True),
                jax.lax.all_gather(y, "d", tiled=True), jax.lax.psum(z, "d"))

    f = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(P(), P("d"), P("d")),
                              out_specs=(P("d"), P(), P()), check_vma=False))
    args = (jnp.ones((64, 16), jnp.float32), jnp.ones((3 * n, 5), jnp.float32),
            jnp.ones((7 * n,), jnp.float32))
    return f.lower(*args).compile().as_text()


def test_collectives_parser_on_a_compiled_program():
    n = 8
    ops = common.collectives(_compiled_hlo(n), n)
    assert set(ops) == {"reduce-scatter", "all-gather", "all-reduce"}
    ring = (n - 1) / n
    rs, ag, ar = ops["reduce-scatter"], ops["all-gather"], ops["all-reduce"]
    # Payload: the operand of the reduce-scatter, the result of the all-gather and all-reduce.
    assert (rs["count"], rs["elements"], rs["bytes"]) == (1, 64 * 16, 64 * 16 * 4)
    assert (ag["count"], ag["elements"], ag["bytes"]) == (1, 3 * n * 5, 3 * n * 5 * 4)
    assert (ar["count"], ar["elements"], ar["bytes"]) == (1, 7, 7 * 4)
    np.testing.assert_allclose([rs["ring"], ag["ring"], ar["ring"]],
                               [ring * 4096, ring * 480, 2 * ring * 28])


def test_collectives_parser_group_sizes_and_async_forms():
    hlo = "\n".join([
        "  %ag = (f32[4]{0}, f32[16]{0}) all-gather-start(f32[4]{0} %p), "
        "replica_groups={{0,1,2,3},{4,5,6,7}}, dimensions={0}",
        "  %agd = f32[16]{0} all-gather-done((f32[4]{0}, f32[16]{0}) %ag)",
        "  %rs = bf16[2,3]{1,0} reduce-scatter(bf16[4,3]{1,0} %q), replica_groups=[4,2]<=[8], "
        "dimensions={0}",
    ])
    ops = common.collectives(hlo, 8)
    assert ops["all-gather"] == dict(count=1, elements=16, bytes=64, ring=64 * 3 / 4)
    assert ops["reduce-scatter"] == dict(count=1, elements=12, bytes=24, ring=24 / 2)


def test_nanochat_params_shapes_and_stack_flops():
    params = common.nanochat_params(64, 2, 256)
    assert params["blocks"][1]["mlp"]["c_proj"]["kernel"].shape == (256, 64)
    assert common.to_torch_layout(params)["lm_head"]["weight"].shape == (256, 64)
    import muon_optax
    tx = muon_optax.muon_adamw(common.nanochat_groups(64), common.nanochat_labels(params))
    rows = common.stack_rows(tx, params, compute_dtype=jnp.float32)
    assert sorted(r["stack"] for r in rows) == [(4, 64, 256), (8, 64, 64)]
    square = next(r for r in rows if r["stack"] == (8, 64, 64))
    assert square["flops"] == square["direct"] == 8 * 5 * (4 * 64**3 + 2 * 64**3)


SCRIPTS = ("step_time.py", "sharded.py")


def test_each_script_quick_mode_runs(tmp_path):
    """Each kept script's --quick run, both at once (each compiles on about one core)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    env.pop("XLA_FLAGS", None)  # as from a shell: sharded.py sets its own device count
    runs = {script: subprocess.Popen(
        [sys.executable, f"benchmarks/{script}", "--quick", "--json", str(tmp_path / script)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for script in SCRIPTS}
    try:
        outputs = {script: run.communicate(timeout=240) for script, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
    for script, (stdout, stderr) in outputs.items():
        assert runs[script].returncode == 0, f"{script}:\n{stderr[-3000:]}"
        assert "|---" in stdout and (tmp_path / script).exists(), script
