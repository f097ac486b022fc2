"""A state knows the layout it was made for: ``update`` refuses it under another one.

The same params on the same 4 devices, first replicated, then split along their layer
axis: the Muon buffers have the same shapes, but their rows belong to other matrices.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")

GROUPS = {"muon": dict(kind="muon", lr=0.02), "adamw": dict(kind="adamw", lr=1e-3)}


def problem():
    rng = np.random.default_rng(0)
    params = {"blocks": jnp.asarray(rng.normal(size=(8, 32, 16)), jnp.float32),
              "bias": jnp.asarray(rng.normal(size=(8,)), jnp.float32)}
    grads = [jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
             for _ in range(2)]
    labels = {"blocks": "muon", "bias": "adamw"}
    return params, grads, labels


def place(mesh, tree, specs):
    return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)), tree, specs)


def test_state_made_for_another_layout_is_refused_and_export_import_moves_it():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, grads, labels = problem()
    replicated = {"blocks": P(), "bias": P()}
    by_layer = {"blocks": P("data"), "bias": P()}
    tx = muon_optax.muon_adamw(GROUPS, labels, axis_name="data", mesh=mesh)
    p_rep = place(mesh, params, replicated)
    state = tx.init(p_rep)
    u, state = tx.update(place(mesh, grads[0], replicated), state, p_rep)
    p_rep = optax.apply_updates(p_rep, u)

    # the same arrays split along the layer axis: same shapes, other owners
    p_split = place(mesh, p_rep, by_layer)
    g_split = place(mesh, grads[1], by_layer)
    with pytest.raises(ValueError, match="another layout.*export_state.*import_state"):
        tx.update(g_split, state, p_split)
    # Under jax.jit on Auto axes traced params do not show their layout: the step takes
    # them as laid out as the state records (XLA moves them there): the replicated step.
    jitted = jax.jit(tx.update)(g_split, state, p_split)
    replicated_step = jax.jit(tx.update)(place(mesh, grads[1], replicated), state, p_rep)
    for a, b in zip(jax.tree.leaves(jitted), jax.tree.leaves(replicated_step)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))

    # the hop done right follows the one-device run
    moved = muon_optax.import_state(tx, muon_optax.export_state(tx, state, p_rep), p_split)
    u_split, _ = tx.update(g_split, moved, p_split)
    one = muon_optax.muon_adamw(GROUPS, labels)
    s1 = one.init(params)
    u1, s1 = one.update(grads[0], s1, params)
    p1 = optax.apply_updates(params, u1)
    u1, _ = one.update(grads[1], s1, p1)
    for a, b in zip(jax.tree.leaves(u_split), jax.tree.leaves(u1)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=1e-6)


def test_layout_is_static_structure_and_the_same_for_the_same_layout():
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, _, labels = problem()
    tx = muon_optax.muon_adamw(GROUPS, labels, axis_name="data", mesh=mesh)
    a = tx.init(place(mesh, params, {"blocks": P(), "bias": P()}))
    b = tx.init(place(mesh, params, {"blocks": P(), "bias": P()}))
    c = tx.init(place(mesh, params, {"blocks": P("data"), "bias": P()}))
    assert jax.tree.structure(a) == jax.tree.structure(b)
    assert jax.tree.structure(a) != jax.tree.structure(c)
    assert len(jax.tree.leaves(a)) == len(jax.tree.leaves(a._replace(layout=None)))
    assert a.layout.devices == 4 and "gather" in a.layout.transports
    assert "local" in c.layout.transports


def test_the_layouts_seen_at_init_travel_in_the_state_not_in_the_transformation():
    """An eager init on placed params records their layouts in the state; a second,
    freshly built transformation (never shown placed params) steps that state under
    ``jax.jit`` on Auto axes, where traced params do not show their layout, exactly as
    the first: the layout is the state's, not hidden in the object that made it."""
    mesh = jax.make_mesh((4,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    params, grads, labels = problem()
    specs = {"blocks": P(None, "data"), "bias": P()}
    params, grads = place(mesh, params, specs), [place(mesh, g, specs) for g in grads]

    def make():
        return muon_optax.muon_adamw(GROUPS, labels, axis_name="data", mesh=mesh)

    state = make().init(params)
    assert state.layout.specs == (((),), ((), ("data",), ())), state.layout
    steps = [jax.jit(tx.update) for tx in (make(), make())]
    (u1, s1), (u2, s2) = (step(grads[0], state, params) for step in steps)
    for a, b in zip(jax.tree.leaves((u1, s1)), jax.tree.leaves((u2, s2))):
        np.testing.assert_array_equal(a, b)
    # Without the recorded layouts (a state made abstractly) a traced update cannot tell.
    bare = state._replace(layout=dataclasses.replace(state.layout, specs=None))
    with pytest.raises(ValueError, match="param_specs"):
        jax.jit(make().update)(grads[0], bare, params)
