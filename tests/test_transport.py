"""Sharded params under plain jit (mesh=): every layout moves whole matrices to owners.

One params tree holds one Muon leaf per layout (replicated, FSDP on either matrix side,
Megatron column- and row-parallel, both sides on a 2-D mesh, scanned leaves split on
their layer axis or a matrix axis) and AdamW leaves split, odd-shaped and small. Fed
identical gradients, the sharded step must equal the one-device step (1e-5 relative
change over 5 steps), on Auto and Explicit meshes.
"""


import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

DM = ("data", "model")
LAYOUTS = {  # name: (shape, spec on the (4, 2) ("data", "model") mesh)
    "replicated": ((16, 32), P()),
    "fsdp_in": ((32, 16), P("data", None)),
    "fsdp_out": ((16, 32), P(None, "data")),
    "tp_column": ((16, 32), P(None, "model")),
    "tp_row": ((32, 16), P("model", None)),
    "fsdp_tp": ((32, 32), P("data", "model")),
    "scan_layers": ((8, 16, 16), P(DM, None, None)),
    "scan_in": ((2, 16, 32), P(None, "data", None)),
    "scan_out": ((3, 16, 32), P(None, None, DM)),
}
ADAMW = {"embed": ((40, 12), P("data", None)), "odd": ((7, 5), P()), "gain": ((12,), P())}


def problem():
    shapes = {k: s for k, (s, _) in {**LAYOUTS, **ADAMW}.items()}
    specs = {k: spec for k, (_, spec) in {**LAYOUTS, **ADAMW}.items()}
    rng = np.random.default_rng(0)
    params = {k: (0.5 * rng.standard_normal(s)).astype(np.float32) for k, s in shapes.items()}
    labels = {k: ("adamw" if k in ADAMW else "muon2" if k.startswith("scan") else "muon")
              for k in shapes}
    return params, specs, labels


def grads(step, params):
    rng = np.random.default_rng(step + 1)
    return {k: (0.5 * rng.standard_normal(x.shape)).astype(np.float32)
            for k, x in params.items()}


def mesh_of(axis_type):
    return jax.make_mesh((4, 2), DM, axis_types=(axis_type,) * 2)


def stepper(tx):
    def apply(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s
    return jax.jit(apply, compiler_options=sp.FAST_COMPILE)


def place(tree, specs, mesh):
    return {k: jax.device_put(x, NamedSharding(mesh, specs[k])) for k, x in tree.items()}


def relative_change_error(got, want, before):
    err = np.linalg.norm(np.asarray(got, np.float64) - want)
    return err / max(np.linalg.norm(want - np.asarray(before, np.float64)), 1e-30)


@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto], ids=["explicit", "auto"])
def test_every_layout_matches_one_device(axis_type):
    params, specs, labels = problem()
    mesh = mesh_of(axis_type)
    hint = specs if axis_type == AxisType.Auto else None    # Auto: layouts not in types
    tx = muon_optax.muon_adamw(sp.groups(), labels, axis_name=DM, mesh=mesh, param_specs=hint)
    single = muon_optax.muon_adamw(sp.groups(), labels)
    kinds = {m: s["transport"] for s in tx.init.stack_info(place(params, specs, mesh))
             for m in s["members"]}
    assert kinds == {"replicated": "gather", "scan_layers": "local",
                     **{k: "exchange" for k in LAYOUTS if k not in ("replicated",
                                                                     "scan_layers")}}
    state, state1 = jax.jit(tx.init)(place(params, specs, mesh)), single.init(params)
    step, step1 = stepper(tx), stepper(single)
    p, p1 = place(params, specs, mesh), params
    for s in range(5):
        p, state = step(p, state, place(grads(s, params), specs, mesh))
        p1, state1 = step1(p1, state1, grads(s, params))
    for k in params:
        assert relative_change_error(p[k], np.asarray(p1[k], np.float64), params[k]) <= 1e-5, k
        if axis_type == AxisType.Explicit:
            assert p[k].sharding.is_equivalent_to(NamedSharding(mesh, specs[k]), p[k].ndim), k
    for leaf in jax.tree.leaves(state.muon):
        assert leaf.sharding.is_equivalent_to(NamedSharding(mesh, P(DM)), leaf.ndim)
    got = muon_optax.export_state(tx, state, p)
    want = muon_optax.export_state(single, state1, p1)
    for a, b in zip(jax.tree.leaves(got["momentum"]), jax.tree.leaves(want["momentum"])):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def fsdp_problem(n):
    """nanochat-like params, every >= 2-D leaf split over "data" on its first axis."""
    params, labels, groups = sp.nanochat_like()
    specs = jax.tree.map(lambda x: P("data") if x.ndim == 2 else P(), params)
    mesh = sp.make_mesh((n,))
    zeros = jax.tree.map(lambda x, spec: jax.device_put(np.zeros(x.shape, x.dtype),
                                                        NamedSharding(mesh, spec)), params, specs)
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data", mesh=mesh, param_specs=specs)
    return tx, zeros, mesh


def test_fsdp_moves_muon_matrices_by_all_to_all_only():
    n = 8
    tx, params, mesh = fsdp_problem(n)
    state = jax.jit(tx.init)(params)
    compiled = stepper(tx).lower(params, state, params).compile()
    ops = sp.collectives(compiled.as_text(), n)
    assert ops["all-to-all"]["count"] == 2
    # No all-gather at all: every leaf is split, AdamW ones updated where they lie.
    assert "all-gather" not in ops and "all-reduce" not in ops, ops
    _, labels, groups = sp.nanochat_like()
    muon_bytes = sum(x.size * 4 for x, label in zip(jax.tree.leaves(params),
                                                  jax.tree.leaves(labels(params)))
                     if label == "matrix")
    # Two all-to-alls of each device's share of the Muon gradients, padding counted.
    assert ops["all-to-all"]["ring"] <= 2 * (n - 1) / n * muon_bytes / n * 1.1
    per_device = sp.per_device_bytes(state, mesh.devices.flatten().tolist())
    whole = sum(x.size for x in jax.tree.leaves(jax.eval_shape(
        muon_optax.muon_adamw(groups, labels).init, params))) * 4
    assert max(per_device) <= 1.1 * whole / n + 4 * 64, (per_device, whole / n)


def test_layout_errors_are_clear():
    params, specs, labels = problem()
    mesh = mesh_of(AxisType.Explicit)
    data_only = muon_optax.muon_adamw(sp.groups(), labels, axis_name="data", mesh=mesh)
    with pytest.raises(ValueError, match=r"'\w+' is split over mesh axis 'model'.*axis_name"):
        jax.jit(data_only.init)(place(params, specs, mesh))
    with pytest.raises(ValueError, match="'nope'"):
        muon_optax.muon_adamw(sp.groups(), labels, axis_name=("data", "nope"), mesh=mesh)
    other = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    tx = muon_optax.muon_adamw(sp.groups(), labels, axis_name="data", mesh=other)
    with pytest.raises(ValueError, match="mesh"):
        jax.jit(tx.init)(place(params, specs, mesh))


def test_transports_hold_after_a_step_what_they_held_when_built(monkeypatch):
    """The Muon loop's transports are values in, values out: after a traced step (every
    transport, clipping on) the Transports, its sources and its sinks hold what they
    held when built; the clip factor, a stack's copy, the stored directions and the
    pieces sent travel through the loop instead."""
    from muon_optax.step import engine

    def held(x):   # every attribute, and every entry of a dict attribute, by identity
        return {(a, k): id(w) for a, v in vars(x).items()
                for k, w in (v.items() if isinstance(v, dict) else [(None, v)])}

    built = []

    class Recorded(engine.Transports):
        def __init__(self, *args):
            super().__init__(*args)
            parts = [self, *self.sources.values(), *self.sinks.values()]
            built.append([(x, held(x)) for x in parts])

    monkeypatch.setattr(engine, "Transports", Recorded)
    params, specs, labels = problem()
    mesh = mesh_of(AxisType.Explicit)
    tx = muon_optax.muon_adamw(sp.groups(), labels, axis_name=DM, mesh=mesh, max_grad_norm=1.0)
    p = place(params, specs, mesh)
    jax.eval_shape(tx.update, p, jax.jit(tx.init)(p), p)
    assert built and {type(x).__name__ for parts in built for x, _ in parts} >= {
        "GatherSource", "GatherSink", "ExchangeSource", "ExchangeSink", "LocalSource",
        "LocalSink"}
    for parts in built:
        for x, before in parts:
            assert held(x) == before, type(x).__name__
