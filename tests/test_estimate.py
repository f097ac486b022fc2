"""muon_optax.estimate against the compiled programs it describes (8 simulated devices)."""

import jax
import jax.numpy as jnp
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


@pytest.fixture(autouse=True)
def _steps_written_out(monkeypatch):
    # XLA's cost analysis counts a loop's body once: the polar iteration is written out
    # here so that the compiled FLOPs count each of its steps, as estimate does.
    monkeypatch.setattr(muon_optax.rule.polar, "UNROLL_STEPS", True)


def _bytes_per_device(tree, mesh):
    per_device = [0] * mesh.size
    order = mesh.devices.flatten().tolist()
    for x in jax.tree.leaves(tree):
        for shard in x.addressable_shards:
            per_device[order.index(shard.device)] += shard.data.nbytes
    return per_device


def _ring_bytes(hlo, n):
    return sum(op["ring"] for op in sp.collectives(hlo, n).values())


def _compiled_zero2_step(tx, params, n, est):
    """The ZeRO-2 step of ``tx`` on ``n`` devices, compiled; its state's bytes per device
    checked against ``est`` on the way."""
    mesh = sp.make_mesh((n,))
    specs = muon_optax.state_specs(tx, params, mesh)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(zeros)
    assert _bytes_per_device(state, mesh) == est["state_bytes"]

    def step(p, s, g):
        u, s = tx.update(jax.tree.map(lambda x: x[0], g), s, p)
        return optax.apply_updates(p, u), s

    grads = jax.tree.map(lambda x: jnp.zeros((n,) + x.shape, x.dtype), zeros)
    return jax.jit(jax.shard_map(step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs))).lower(zeros, state, grads).compile()


@pytest.mark.parametrize("n", [3, 8])
def test_estimate_matches_the_compiled_zero2_step(n):
    params, labels, groups = sp.nanochat_like()
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    est = muon_optax.estimate(tx, params, n)
    compiled = _compiled_zero2_step(tx, params, n, est)
    flops = compiled.cost_analysis()["flops"]
    assert abs(est["program_flops"] - flops) <= 0.1 * flops, (est["program_flops"], flops)
    assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])
    assert len(est["muon_flops"]) == len(est["state_bytes"]) == n


def test_estimate_matches_the_compiled_fsdp_step():
    n = 8
    params, labels, groups = sp.nanochat_like()
    mesh = sp.make_mesh((n,))
    specs = jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), params)
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data", mesh=mesh, param_specs=specs)
    est = muon_optax.estimate(tx, params, n, param_specs=specs)
    placed = jax.tree.map(lambda x, s: jax.device_put(jnp.zeros(x.shape, x.dtype),
                                                      NamedSharding(mesh, s)), params, specs)
    state = jax.jit(tx.init)(placed)
    assert _bytes_per_device(state, mesh) == est["state_bytes"]

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step).lower(placed, state, placed).compile()
    flops = compiled.cost_analysis()["flops"]
    assert abs(est["program_flops"] - flops) <= 0.1 * flops, (est["program_flops"], flops)
    assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])
    assert {s["transport"] for s in est["stacks"]} == {"exchange"}


def test_estimate_counts_gathered_blocks_and_the_guard():
    """Head blocks cut by FSDP are gathered whole (grads and params all-gathered on entry),
    and max_grad_norm/skip_nonfinite add an all-reduce and the skipped counter."""
    n, d = 4, 384
    D = muon_optax.MuonDimensionNumbers
    params = {"qkv": jax.ShapeDtypeStruct((d, 3 * d), jnp.float32),
              "o": jax.ShapeDtypeStruct((d, d), jnp.float32),
              "fc": jax.ShapeDtypeStruct((d, 4 * d), jnp.float32),
              "b": jax.ShapeDtypeStruct((d,), jnp.float32)}
    dims = {"qkv": D(0, 1, output_blocks=18), "o": D(0, 1, reduction_blocks=6),
            "fc": D(0, 1), "b": None}
    labels = {"qkv": "m", "o": "m", "fc": "m", "b": "a"}
    specs = {"qkv": P(None, "data"), "o": P("data", None), "fc": P(None, "data"), "b": P()}
    groups = {"m": dict(kind="muon", lr=0.02), "a": dict(kind="adamw", lr=1e-3)}
    mesh = sp.make_mesh((n,))
    for extra in ({}, dict(max_grad_norm=1.0, skip_nonfinite=True)):
        tx = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims, axis_name="data",
                                   mesh=mesh, param_specs=specs, **extra)
        with pytest.warns(UserWarning, match="cuts its"):
            est = muon_optax.estimate(tx, params, n, param_specs=specs)
        placed = jax.tree.map(lambda x, s: jax.device_put(jnp.zeros(x.shape, x.dtype),
                                                          NamedSharding(mesh, s)),
                              params, specs)
        with pytest.warns(UserWarning, match="cuts its"):
            state = jax.jit(tx.init)(placed)
        assert _bytes_per_device(state, mesh) == est["state_bytes"]

        def step(p, s, g):
            u, s = tx.update(g, s, p)
            return optax.apply_updates(p, u), s

        with pytest.warns(UserWarning, match="cuts its"):
            compiled = jax.jit(step).lower(placed, state, placed).compile()
        assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])


def test_estimate_counts_the_guard_in_zero2():
    n = 4
    params, labels, groups = sp.nanochat_like()
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data", max_grad_norm=1.0,
                               skip_nonfinite=True)
    est = muon_optax.estimate(tx, params, n)
    compiled = _compiled_zero2_step(tx, params, n, est)
    assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])


def test_estimate_counts_the_adaptive_duals_gather():
    """contrib_muon(adaptive=True) sums each leaf's <U, O> over its matrices, whichever
    devices own them: every device's slot values are all-gathered, in both forms."""
    n = 8
    params, _, _ = sp.nanochat_like()
    params = dict(params["blocks"]["0"]["mlp"])
    tx = muon_optax.contrib_muon(0.02, axis_name="data", adaptive=True)
    est = muon_optax.estimate(tx, params, n)
    compiled = _compiled_zero2_step(tx, params, n, est)
    assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])

    mesh = sp.make_mesh((n,))
    tx = muon_optax.contrib_muon(0.02, axis_name="data", mesh=mesh, param_specs=P("data"),
                                 adaptive=True)
    est = muon_optax.estimate(tx, params, n, param_specs=P("data"))
    placed = jax.tree.map(lambda x: jax.device_put(jnp.zeros(x.shape, x.dtype),
                                                   NamedSharding(mesh, P("data"))), params)

    def step(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    compiled = jax.jit(step).lower(placed, jax.jit(tx.init)(placed), placed).compile()
    assert _ring_bytes(compiled.as_text(), n) == pytest.approx(est["collective_bytes"][0])
