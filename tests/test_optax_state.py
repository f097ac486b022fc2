"""optax.contrib.muon's state continues on contrib_muon (import_state), and back
(export_state(as_optax=True)): 3 steps on one, 3 on the other, as if uninterrupted."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers as MDN
from test_contrib import CASES, TOL, random_tree

import muon_optax
from muon_optax.rule.coefficients import DION_COEFFS

STATIC = ("ns_steps", "eps")   # contrib_muon's static arguments, for inject_hyperparams

MOVES = {
    "defaults": (lambda f: f(learning_rate=0.02)),
    "one_step": (lambda f: f(learning_rate=0.02, ns_steps=1)),
    "table_decay_mask_schedule": (
        lambda f: f(**CASES["polar_express_table_decay_mask_schedule"])),
    "no_nesterov_aol_bf16_momentum": (lambda f: f(**CASES["no_nesterov_aol_bf16_momentum"])),
    "adam_options_schedules": (lambda f: f(**CASES["adam_options_decay_schedule"])),
    "dimension_numbers_dion": (lambda f: f(
        **CASES["dimension_numbers_batch_axes_aol_adaptive"], ns_coeffs="dion")),
    "chain_with_clip": (lambda f: optax.chain(optax.clip_by_global_norm(1.0),
                                              f(learning_rate=0.02, weight_decay=0.1))),
    "inject_hyperparams": (lambda f: optax.inject_hyperparams(f, static_args=STATIC)(
        learning_rate=0.02, weight_decay=0.1, beta=0.9)),
}


def steps(tx, params, state, first, n=3):
    update = jax.jit(tx.update)
    for step in range(first, first + n):
        updates, state = update(random_tree(100 + step), state, params)
        params = optax.apply_updates(params, updates)
    return params, state


def assert_same_change(got, want, start):
    for (path, w), g, a in zip(jax.tree_util.tree_flatten_with_path(want)[0],
                               jax.tree.leaves(got), jax.tree.leaves(start)):
        change = np.asarray(w, np.float64) - np.asarray(a, np.float64)
        diff = np.asarray(g, np.float64) - np.asarray(w, np.float64)
        rel = np.linalg.norm(diff) / np.linalg.norm(change)
        assert rel <= TOL, f"{jax.tree_util.keystr(path)}: relative error {rel:.2e}"


@pytest.mark.parametrize("name", list(MOVES))
def test_an_optax_run_continues_on_contrib_muon_and_returns(name):
    make = MOVES[name]
    theirs, ours = make(optax.contrib.muon), make(muon_optax.contrib_muon)
    p0 = random_tree(0)
    p3, s3 = steps(theirs, p0, theirs.init(p0), 0)
    p6, s6 = steps(theirs, p3, s3, 3)
    state = muon_optax.import_state(ours, s3, p3)
    assert jax.tree.structure(state) == jax.tree.structure(ours.init(p0))
    q6, ours6 = steps(ours, p3, state, 3)
    assert_same_change(q6, p6, p3)
    # ... and back: optax continues from the exported state as it would from its own.
    back = muon_optax.export_state(ours, ours6, q6, as_optax=True)
    assert jax.tree.structure(back) == jax.tree.structure(s6)
    for b, s in zip(jax.tree.leaves(back), jax.tree.leaves(s6)):
        assert (b.shape, b.dtype) == (s.shape, s.dtype)
    p9, _ = steps(theirs, p6, s6, 6)
    r9, _ = steps(theirs, q6, back, 6)
    assert_same_change(r9, p9, p6)


def test_import_then_export_gives_optax_state_back_exactly():
    kw = dict(learning_rate=optax.linear_schedule(0.02, 0.0, 10), weight_decay=0.1,
              weight_decay_mask=lambda p: jax.tree.map(lambda _: True, p),
              ns_coeffs=DION_COEFFS, mu_dtype=jnp.bfloat16)
    theirs, ours = optax.contrib.muon(**kw), muon_optax.contrib_muon(**kw)
    p0 = random_tree(0)
    p2, s2 = steps(theirs, p0, theirs.init(p0), 0, n=2)
    back = muon_optax.export_state(ours, muon_optax.import_state(ours, s2, p2), p2,
                                   as_optax=True)
    assert jax.tree.structure(back) == jax.tree.structure(s2)
    for b, s in zip(jax.tree.leaves(back), jax.tree.leaves(s2)):
        assert b.dtype == s.dtype
        np.testing.assert_array_equal(np.asarray(b, np.float32), np.asarray(s, np.float32))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_an_optax_state_continues_sharded(mode):
    """Onto params FSDP-split over a mesh (mesh=), or ZeRO-2 inside shard_map (the state
    made for 8 devices, num_devices=8), and back to optax."""
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = 8
    kw = dict(learning_rate=0.02, weight_decay=0.1)
    theirs = optax.contrib.muon(**kw)
    p0 = random_tree(0)
    p3, s3 = steps(theirs, p0, theirs.init(p0), 0)
    p6, s6 = steps(theirs, p3, s3, 3)
    if mode == "fsdp":
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
        ours = muon_optax.contrib_muon(**kw, axis_name="data", mesh=mesh)
        spec = lambda x: P("data") if x.ndim >= 2 and x.shape[0] % n == 0 else P()  # noqa: E731
        params = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, spec(x))), p3)
        state = muon_optax.import_state(ours, s3, params)
        q6, ours6 = steps(ours, params, state, 3)
        back = muon_optax.export_state(ours, ours6, q6, as_optax=True)
        # optax steps on one device: gather the params and its state.
        q6, back = jax.tree.map(lambda x: jnp.asarray(np.asarray(x)), (q6, back))
    else:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
        ours = muon_optax.contrib_muon(**kw, axis_name="data")
        specs = muon_optax.state_specs(ours, p3, mesh)
        state = muon_optax.import_state(ours, s3, p3, num_devices=n)
        step = jax.jit(jax.shard_map(
            lambda g, s, p: ours.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh,
            in_specs=(P("data"), specs, P()), out_specs=(P(), specs)))
        every = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), t)  # noqa
        params = p3
        for t in range(3, 6):
            updates, state = step(every(random_tree(100 + t)), state, params)
            params = optax.apply_updates(params, updates)
        q6 = params
        back = muon_optax.export_state(ours, state, q6, as_optax=True)
    assert_same_change(q6, p6, p3)
    r9, _ = steps(theirs, q6, back, 6)
    p9, _ = steps(theirs, p6, s6, 6)
    assert_same_change(r9, p9, p6)


def _optax_state(**kw):
    tx = optax.contrib.muon(**kw)
    return tx.init(random_tree(0))


@pytest.mark.parametrize("theirs, ours, msg", [
    (dict(mu_dtype=jnp.bfloat16), {}, "pass the optax run's mu_dtype"),
    ({}, dict(mu_dtype=jnp.bfloat16), "pass the optax run's mu_dtype"),
    (dict(ns_coeffs="dion"), {}, "pass the optax run's ns_coeffs and ns_steps"),
    (dict(ns_steps=3, ns_coeffs=DION_COEFFS[:3]), dict(ns_steps=4, ns_coeffs=DION_COEFFS[:4]),
     "pass the optax run's ns_coeffs"),
    (dict(weight_decay_mask=lambda p: jax.tree.map(lambda _: True, p)), {},
     "holds masked .MaskedState. of a constant .EmptyState. there, this contrib_muon a "
     "constant .EmptyState.: pass the optax run's weight_decay, weight_decay_mask"),
    ({}, dict(learning_rate=optax.constant_schedule(0.02)),
     "learning_rate: the optax run's state holds a constant .EmptyState. there, this "
     "contrib_muon a schedule"),
    (dict(weight_decay=optax.constant_schedule(0.1)), dict(weight_decay=0.1),
     "pass the optax run's weight_decay, weight_decay_mask"),
    (dict(muon_weight_dimension_numbers={
        "blocks": {"fc": MDN(), "proj": MDN(), "attn": MDN(), "scale": None},
        "embed": MDN(), "bias": None, "gain": None, "stack": MDN(1, 2)}), {},
     "the optax run runs Muon on 'stack'"),
])
def test_arguments_that_the_state_shows_must_agree(theirs, ours, msg):
    state = _optax_state(learning_rate=0.02, **theirs)
    tx = muon_optax.contrib_muon(**{"learning_rate": 0.02, **ours})
    with pytest.raises(ValueError, match=msg):
        muon_optax.import_state(tx, state, random_tree(0))


def test_counts_that_differ_and_other_transformations_are_refused():
    params = random_tree(0)
    state = _optax_state(learning_rate=0.02)
    muon_part = state.inner_states["muon"].inner_state
    odd = state._replace(inner_states={
        **state.inner_states,
        "muon": state.inner_states["muon"]._replace(
            inner_state=(muon_part[0]._replace(count=jnp.int32(4)),) + muon_part[1:])})
    with pytest.raises(ValueError, match="the step counts in optax's state differ"):
        muon_optax.import_state(muon_optax.contrib_muon(0.02), odd, params)
    with pytest.raises(TypeError, match="belongs to muon_optax.contrib_muon"):
        muon_optax.import_state(muon_optax.muon(0.02), state, params)
    with pytest.raises(ValueError, match="are not tx.s .*Wrap contrib_muon as optax.contrib"):
        muon_optax.import_state(optax.chain(optax.clip(1.0), muon_optax.contrib_muon(0.02)),
                                state, params)
    with pytest.raises(TypeError, match="belongs to muon_optax.contrib_muon"):
        tx = muon_optax.muon_adamw({"m": dict(kind="muon", lr=0.02)},
                                   lambda p: jax.tree.map(lambda _: "m", p))
        muon_optax.export_state(tx, tx.init({"w": jnp.ones((4, 4))}), {"w": jnp.ones((4, 4))},
                                as_optax=True)
