"""The benchmarks' shared helpers, and that each kept benchmark script runs (--quick)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
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


def test_collectives_parser_mesh_groups_and_chained_pieces():
    """The TPU compiler's forms: groups named by mesh axes, and one all-gather run in
    pieces inside several fusions (each piece the whole op, one chain_id): counted once."""
    groups = "replica_groups=mesh['data'=4,'model'=2] {'model'}, dimensions={0}"
    piece = ("  %ag.{i} = f32[256,64]{{1,0:T(8,128){s}}} all-gather(f32[128,64]{{1,0}} %p.{i}), "
             "{groups}, frontend_attributes={{chain_id=\"0\"}}")
    hlo = "\n".join([piece.format(i=i, s="S(1)" if i else "", groups=groups)
                     for i in range(5)] + [
        "  %a2a = f32[2,8]{1,0} all-to-all(f32[2,8]{1,0} %q), "
        "replica_groups=mesh['data'=4,'model'=2] {'data','model'}, dimensions={0}",
        "  %ar = f32[8]{0} all-reduce(f32[8]{0} %r), replica_groups=mesh['x'=8] {'data'}",
    ])
    ops = common.collectives(hlo, 8)
    assert ops["all-gather"] == dict(count=1, elements=256 * 64, bytes=256 * 64 * 4,
                                     ring=256 * 64 * 4 / 2)
    assert ops["all-to-all"]["ring"] == 64 * 7 / 8
    assert ops["all-reduce"]["ring"] == 32 * 2 * 7 / 8   # axes it cannot name: all devices
    chains: set = set()   # one module read computation by computation: still once
    twice = [common.collectives(piece.format(i=i, s="", groups=groups), 8, chains)
             for i in range(2)]
    assert [o.get("all-gather", {}).get("count", 0) for o in twice] == [1, 0]


def test_nanochat_params_shapes_and_stack_flops():
    params = common.nanochat_params(64, 2, 256)
    assert params["blocks"][1]["mlp"]["c_proj"]["kernel"].shape == (256, 64)
    assert common.to_torch_layout(params)["lm_head"]["weight"].shape == (256, 64)
    import muon_optax
    tx = muon_optax.muon_adamw(common.nanochat_groups(64), common.nanochat_labels(params))
    rows = common.stack_rows(tx, params, compute_dtype=jnp.float32)
    # Stored as laid out: c_fc (64, 256) and c_proj (256, 64) in stacks of their own.
    assert sorted(r["stack"] for r in rows) == [(2, 64, 256), (2, 256, 64), (8, 64, 64)]
    square = next(r for r in rows if r["stack"] == (8, 64, 64))
    assert square["flops"] == square["direct"] == 8 * 5 * (4 * 64**3 + 2 * 64**3)


def test_fsdp_spec_splits_the_first_divisible_axis():
    assert common.fsdp_spec((4096, 64), 8) == P("data", None)
    assert common.fsdp_spec((3, 16), 8) == P(None, "data")
    assert common.fsdp_spec((4,), 8) == P(None)


def test_exact_optimum_against_brute_force():
    import itertools
    for k1, c1, k2, c2, n in [(3, 5, 4, 2, 2), (2, 7, 5, 3, 3), (4, 4, 1, 1, 3)]:
        costs = [c1] * k1 + [c2] * k2
        brute = min(max(sum(c for c, d in zip(costs, owners) if d == dev) for dev in range(n))
                    for owners in itertools.product(range(n), repeat=len(costs)))
        assert common.exact_optimum(k1, c1, k2, c2, n) == brute


def test_balance_rows_match_the_known_cases():
    from benchmarks import sharded
    d12 = sharded.balance(12, 8)
    # nanochat d12 on 8 devices: 6 small + 2 + 2 big slots per device, 1.22x the state
    # optimum (design notes); per-stack padding is even there.
    assert d12["state_nanochat"] == pytest.approx(22 / 18)
    assert d12["flops_per_stack"] == d12["state_per_stack"] == 1.0
    d20 = sharded.balance(20, 64)
    assert d20["state_per_stack"] == pytest.approx(1.5)   # issue 14's worst case
    assert max(d20["flops_ours"], d20["state_ours"]) <= 1.05


SCRIPTS = ("step_time.py", "sharded.py", "blocks.py")


def _check_results(tmp_path):
    """What the --quick runs must have measured: every contender, the estimate's state
    bytes equal to the compiled ones, contrib_muon's first step equal to optax's."""
    with open(tmp_path / "sharded.py") as f:
        sharded = json.load(f)
    (costs,) = sharded["costs"]
    assert set(costs["rows"]) == {"optax_contrib_fsdp", "muon_optax_fsdp", "contrib_muon_fsdp",
                                  "muon_optax", "muon_optax_jit"}
    assert all(r["finite"] and r["median_s"] > 0 for r in costs["rows"].values())
    assert set(costs["estimate"]) == set(costs["rows"]) - {"optax_contrib_fsdp"}
    for name, est in costs["estimate"].items():
        assert est["state"] == costs["rows"][name]["state"], name
    assert costs["rows"]["muon_optax_fsdp"]["collectives"].keys() == {"all-to-all"}
    assert "all-reduce" not in costs["rows"]["muon_optax"]["collectives"] or (
        costs["rows"]["muon_optax"]["collectives"]["all-reduce"]["bytes"] < 2**16)
    assert [r["model"] for r in sharded["balance"]] == ["d12", "d20"]
    with open(tmp_path / "step_time.py") as f:
        step = json.load(f)
    assert "contrib_muon/optax_contrib" in step["ratios"]
    assert step["checks"]["contrib_muon vs optax_contrib"]["max_rel"] < 1e-4
    with open(tmp_path / "blocks.py") as f:
        blocks = json.load(f)
    (one,) = blocks["one_device"]
    assert one["rows"]["heads"]["muon"]["attn"] < one["rows"]["whole"]["muon"]["attn"] / 4
    assert all(row["finite"] for row in one["rows"].values())
    (parallel,) = blocks["head_parallel"]
    assert parallel["rows"]["heads"]["transports"] == ["local"]
    assert parallel["rows"]["heads"]["sent"] == 0 < parallel["rows"]["whole"]["sent"]


def test_each_script_quick_mode_runs(tmp_path):
    """Each kept script's --quick run, all at once (each compiles on about one core)."""
    # As from a shell (sharded.py and blocks.py set their own device count), with the
    # suite's cheap code generation: the runs check what is measured, not how fast.
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split()
             if not f.startswith("--xla_force_host_platform_device_count")]
    env = dict(os.environ, PYTHONPATH=str(REPO), XLA_FLAGS=" ".join(flags))
    runs = {script: subprocess.Popen(
        [sys.executable, f"benchmarks/{script}", "--quick", "--json", str(tmp_path / script)],
        cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for script in SCRIPTS}
    try:
        outputs = {script: run.communicate(timeout=300) for script, run in runs.items()}
    finally:
        for run in runs.values():
            run.kill()
    for script, (stdout, stderr) in outputs.items():
        assert runs[script].returncode == 0, f"{script}:\n{stderr[-3000:]}"
        assert "|---" in stdout and (tmp_path / script).exists(), script
    _check_results(tmp_path)


def test_tpu_compile_table_joins_saved_runs(tmp_path, capsys):
    # Runs of the contender and of its baseline saved apart (--json) make one table, the
    # ratios taken across files.
    from benchmarks import tpu_compile

    def row(contender, compile_s, temp):
        return dict(contender=contender, set="d256x4", topology="v5p:1", compile_s=compile_s,
                    compile_cpu_s=compile_s, args=2**20, temp=temp * 2**20, out=2**20,
                    collectives={}, ring=0, hlo_lines=10, dots=1, whiles=1, flops_cost=1e9)
    (tmp_path / "ours.json").write_text(json.dumps([row("one_device", 6.0, 3)]))
    (tmp_path / "base.json").write_text(json.dumps([row("optax", 4.0, 6)]))
    rows = tpu_compile.main(["--table", str(tmp_path / "ours.json"), str(tmp_path / "base.json")])
    assert [r["contender"] for r in rows] == ["one_device", "optax"]
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "one_device" in ln)
    cells = [c.strip() for c in line.split("|")]
    assert cells[4:6] == ["6.0 (6.0)", "1.50"] and cells[7:9] == ["3.0", "0.50"]
    assert cells[10:12] == ["5.0", "0.62"]     # peak: args + temp + out (none aliased)



def test_tpu_compile_repeats_in_rounds_and_reports_medians(monkeypatch, capsys):
    # --repeat: each round compiles every contender once (the machine's drift hits all),
    # each row keeps its median compile times and every CPU time; an error wins.
    from benchmarks import tpu_compile

    calls, times = [], {"fsdp": [9.0, 3.0, 5.0], "optax_fsdp": [2.0, 4.0, 8.0]}

    def child(contender, set_name, topology, vocab, timeout):
        calls.append(contender)
        t = times[contender][sum(c == contender for c in calls) - 1]
        return dict(contender=contender, set=set_name, topology=topology, compile_s=t + 1,
                    compile_cpu_s=t, args=0, temp=2**20, out=0, collectives={}, ring=0,
                    hlo_lines=1, dots=0, whiles=0, flops_cost=0.0)
    monkeypatch.setattr(tpu_compile, "run_child", child)
    rows = tpu_compile.main(["--sets", "d256x4", "--topologies", "v5p:8", "--repeat", "3",
                             "--contenders", "fsdp", "optax_fsdp"])
    assert calls == ["fsdp", "optax_fsdp"] * 3
    assert [(r["compile_cpu_s"], r["compile_s"]) for r in rows] == [(5.0, 6.0), (4.0, 5.0)]
    assert rows[0]["compile_cpu_all"] == [9.0, 3.0, 5.0]
    line = next(ln for ln in capsys.readouterr().out.splitlines() if "| fsdp" in ln)
    assert [c.strip() for c in line.split("|")][4:6] == ["5.0 (6.0)", "1.25"]
    assert tpu_compile.median_row([rows[0], dict(error="compile over 9 s")]) == dict(
        error="compile over 9 s")

def test_tpu_kernels_reads_the_log_and_the_sources():
    """``tpu_kernels``: libtpu's interleaved per-thread log read into kernels and stages,
    and kernels summed by the source line the optimized HLO's stack frames give."""
    from benchmarks import tpu_kernels

    log = "\n".join([
        "I1205 03:38:56.787478   23729 deepsea_compiler_backend.cc:4379] [fusion.1] LLO "
        "optimizing 2,000 instructions",
        "I1205 03:38:56.787553   23730 deepsea_compiler_backend.cc:4379] [copy.2] LLO "
        "optimizing 50 instructions",
        "I1205 03:38:56.791677   23729 deepsea_compiler_backend.cc:3967] XLA::TPU LLO "
        "dependency graph-based optimizations and scheduling time: 1.5 ms (1500 us)",
        "I1205 03:38:56.792221   23730 deepsea_compiler_backend.cc:3967] XLA::TPU LLO "
        "dependency graph-based optimizations and scheduling time: 408 us (408 us)",
        "I1205 03:38:56.793320   23729 deepsea_compiler_backend.cc:3172] LSRAv2 *** total "
        "bundle packing time: 0.5 ms (500 us)",
        "learning/some/file.cc:379",
        "I1205 03:39:17.080682   23726 deepsea_compiler_base.cc:3820] BACKEND_PASSES stage "
        "duration: 20.5s",
        "I1205 03:38:56.222079   23651 deepsea_compiler_hlo_passes.cc:6763] HLO_PASSES stage "
        "duration: 1023.3ms",
        "I1205 03:40:17.080682   23651 deepsea_compiler_base.cc:1033] END_TO_END stage "
        "duration: 1m2.5s",
    ])
    kernels, stages = tpu_kernels.read_log(log)
    assert [(k.name, k.instructions) for k in kernels] == [("fusion.1", 2000), ("copy.2", 50)]
    assert kernels[0].seconds == pytest.approx(2e-3) and kernels[1].seconds == pytest.approx(408e-6)
    assert stages == pytest.approx({"BACKEND_PASSES": 20.5, "HLO_PASSES": 1.0233,
                                    "END_TO_END": 62.5})

    def inner(x):
        return jnp.sin(x) * 3.0

    def outer(x):
        return inner(x) + 1.0

    hlo = jax.jit(outer).lower(jnp.ones(8)).compile().as_text()
    where = tpu_kernels.source_lines(hlo)
    named = {name: chain for name, chain in where.items() if chain and ".inner:" in chain[0]}
    assert named, where
    name, chain = next(iter(named.items()))
    assert "test_benchmarks.py:" in chain[0] and ".inner:" in chain[0], chain
    assert ".outer:" in chain[1], chain   # the caller, one frame out
    rows = tpu_kernels.by_source([tpu_kernels.Kernel(name, 10, 2.0),
                                  tpu_kernels.Kernel(name, 5, 1.0),
                                  tpu_kernels.Kernel("nowhere", 1, 0.5)], where)
    assert rows[0][1:] == (2, 15, 3.0) and ".inner:" in rows[0][0]
    assert rows[1] == ("(no source: glue, copies)", 1, 1, 0.5)
