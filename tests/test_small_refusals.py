"""Small things that used to go through: each refused or handled, naming the fix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

D = muon_optax.MuonDimensionNumbers
GROUPS = {"muon": dict(kind="muon", lr=0.02), "adamw": dict(kind="adamw", lr=1e-3)}
LABELS = {"w": "muon", "b": "adamw"}


def problem():
    rng = np.random.default_rng(0)
    params = {"w": jnp.asarray(rng.normal(size=(4, 24, 16)), jnp.float32),
              "b": jnp.asarray(rng.normal(size=(16,)), jnp.float32)}
    grads = jax.tree.map(lambda x: jnp.asarray(rng.normal(size=x.shape), x.dtype), params)
    return params, grads


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_import_state_from_3_devices_steps_on_5():
    params, grads = problem()
    mesh3 = jax.make_mesh((3,), ("data",), devices=jax.devices()[:3])
    mesh5 = jax.make_mesh((5,), ("data",), devices=jax.devices()[3:8])
    put = lambda mesh, tree: jax.tree.map(  # noqa: E731
        lambda x: jax.device_put(x, NamedSharding(mesh, P())), tree)
    tx3 = muon_optax.muon_adamw(GROUPS, LABELS, axis_name="data", mesh=mesh3)
    p3 = put(mesh3, params)
    state3 = tx3.init(p3)
    _, state3 = jax.jit(tx3.update)(put(mesh3, grads), state3, p3)
    portable = muon_optax.export_state(tx3, state3, p3)

    tx5 = muon_optax.muon_adamw(GROUPS, LABELS, axis_name="data", mesh=mesh5)
    p5 = put(mesh5, params)
    state5 = muon_optax.import_state(tx5, portable, p5)
    assert {d for x in jax.tree.leaves(state5) for d in x.devices()} == set(mesh5.devices.flat)
    u5, _ = jax.jit(tx5.update)(put(mesh5, grads), state5, p5)
    u3, _ = jax.jit(tx3.update)(put(mesh3, grads), state3, p3)
    for a, b in zip(jax.tree.leaves(u5), jax.tree.leaves(u3)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)


def test_invalid_dimension_numbers_of_an_adamw_leaf_are_refused():
    params, _ = problem()
    dims = {"w": None, "b": D(0, 0, output_blocks=3)}
    tx = muon_optax.muon_adamw(GROUPS, LABELS, dimension_numbers=dims)
    with pytest.raises(ValueError, match=r"parameter 'b' is in AdamW group 'adamw'.*share"):
        tx.init(params)
    dims = {"w": None, "b": D(0, 1, output_blocks=0)}
    with pytest.raises(ValueError, match=r"'b'.*output_blocks must be a positive int"):
        muon_optax.muon_adamw(GROUPS, LABELS, dimension_numbers=dims).init(params)
    # valid ones (a prefix or one for all reaching a bias) stay allowed
    muon_optax.muon_adamw(GROUPS, LABELS, dimension_numbers=D(1, 2)).init(params)


def test_max_grad_norm_array_must_be_positive():
    params, _ = problem()
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        muon_optax.muon_adamw(GROUPS, LABELS, max_grad_norm=jnp.asarray(-1.0))
    injected = optax.inject_hyperparams(muon_optax.adamw)(lr=1e-3, max_grad_norm=-1.0)
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        injected.init(params)
    ok = optax.inject_hyperparams(muon_optax.adamw)(lr=1e-3, max_grad_norm=1.0)
    jax.jit(ok.update)(params, jax.jit(ok.init)(params), params)


def test_blocked_second_moment_into_a_transformation_without_blocks_names_dimension_numbers():
    params, grads = problem()
    blocked = muon_optax.muon_adamw(GROUPS, LABELS, dimension_numbers={
        "w": D(1, 2, output_blocks=4), "b": None})
    state = blocked.init(params)
    _, state = blocked.update(grads, state, params)
    portable = muon_optax.export_state(blocked, state, params)
    assert portable["second_moment"]["w"].shape != (4, 1, 16)   # the block view's
    plain = muon_optax.muon_adamw(GROUPS, LABELS)
    with pytest.raises(ValueError, match="dimension_numbers of the one that exported"):
        muon_optax.import_state(plain, portable, params)
