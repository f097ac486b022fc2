"""Warnings that name the fix and point at the user's line, not into the library."""

import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

GROUPS = {"muon": dict(kind="muon", lr=0.02), "adamw": dict(kind="adamw", lr=1e-3)}
D = muon_optax.MuonDimensionNumbers


def _caught(fn):
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = fn()
    return out, [w for w in caught if issubclass(w.category, UserWarning)]


def test_split_params_without_mesh_warn_at_eager_init_naming_mesh():
    mesh = jax.make_mesh((4,), ("data",), devices=jax.devices()[:4])
    params = {"w": jnp.ones((64, 32)), "b": jnp.ones((32,))}
    tx = muon_optax.muon_adamw(GROUPS, muon_optax.label_by_path())
    fsdp = {"w": jax.device_put(params["w"], NamedSharding(mesh, P("data"))),
            "b": jax.device_put(params["b"], NamedSharding(mesh, P()))}
    _, caught = _caught(lambda: tx.init(fsdp))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "'w'" in str(caught[0].message) and "mesh=" in str(caught[0].message)
    assert "axis_name='data'" in str(caught[0].message)
    assert caught[0].filename == __file__
    # replicated params, or one device: nothing to say
    rep = jax.tree.map(lambda x: jax.device_put(x, NamedSharding(mesh, P())), params)
    assert not _caught(lambda: tx.init(rep))[1]
    assert not _caught(lambda: tx.init(params))[1]


def test_heads_split_over_one_axis_of_two_name_that_axis():
    mesh = jax.make_mesh((2, 4), ("data", "model"))
    dims = {"attn": D(0, 1, output_blocks=8), "b": None}
    labels = {"attn": "muon", "b": "adamw"}
    params = {"attn": jax.device_put(jnp.asarray(np.random.default_rng(0).normal(
        size=(64, 128)), jnp.float32), NamedSharding(mesh, P(None, "model"))),
        "b": jax.device_put(jnp.ones((8,)), NamedSharding(mesh, P()))}
    tx = muon_optax.muon_adamw(GROUPS, labels, dimension_numbers=dims,
                               axis_name=("data", "model"), mesh=mesh)
    _, caught = _caught(lambda: tx.init(params))
    assert len(caught) == 1, [str(w.message) for w in caught]
    assert "axis_name='model'" in str(caught[0].message)
    assert caught[0].filename == __file__
    # as the warning says: no gathering, each device updates its own heads
    tx = muon_optax.muon_adamw(GROUPS, labels, dimension_numbers=dims, axis_name="model",
                               mesh=mesh)
    _, caught = _caught(lambda: tx.init(params))
    assert not caught
    rows = {r["path"]: r for r in muon_optax.describe(tx, params, file=None)}
    assert rows["attn"]["transport"] == "local"
