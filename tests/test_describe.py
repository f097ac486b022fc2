"""muon_optax.describe: the plan of a scanned Flax model, as a user checks it."""

import io

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest

import muon_optax

GROUPS = {"adamw": dict(kind="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.0),
          "muon": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                       weight_decay=0.0)}


class Block(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        x = nn.LayerNorm()(x)
        x = nn.Dense(32)(x)
        return nn.DenseGeneral((4, 8))(x).reshape(x.shape[0], 32), None


class Model(nn.Module):
    @nn.compact
    def __call__(self, x):
        x = nn.Embed(100, 32)(x)
        scan = nn.scan(Block, variable_axes={"params": 0}, split_rngs={"params": True},
                       length=3)
        x, _ = scan()(x, None)
        return nn.Dense(100, name="head")(x)


def test_describe_shows_groups_matrices_stacks_and_owners():
    params = Model().init(jax.random.PRNGKey(0), jnp.zeros((2,), jnp.int32))["params"]
    labels = muon_optax.label_by_path([("head", "adamw")])
    tx = muon_optax.muon_adamw(GROUPS, labels, axis_name="data")
    out = io.StringIO()
    rows = {r["path"]: r for r in muon_optax.describe(tx, params, num_devices=4, file=out)}
    text = out.getvalue()
    # Scanned biases and norm scales, (3, d), are AdamW (not orthogonalized).
    for path in ("ScanBlock_0/Dense_0/bias", "ScanBlock_0/LayerNorm_0/scale",
                 "ScanBlock_0/DenseGeneral_0/bias"):
        assert rows[path]["kind"] == "adamw", path
    dense = rows["ScanBlock_0/Dense_0/kernel"]
    assert (dense["kind"], dense["matrices"], dense["matrix"]) == ("muon", 3, (32, 32))
    assert dense["owners"] == [0, 1, 2] and dense["transport"] == "gather"
    # A DenseGeneral kernel (3, 32, 4, 8) is, by default, 96 matrices (8 x 4): the table
    # shows it, so the user can pass MuonDimensionNumbers(1, (2, 3)) instead.
    assert rows["ScanBlock_0/DenseGeneral_0/kernel"]["matrices"] == 96
    assert "ScanBlock_0/Dense_0/kernel" in text and "owners of 4 devices" in text
    general = muon_optax.MuonDimensionNumbers(reduction_axis=1, output_axis=(2, 3))
    dims = lambda p: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, x: general if "DenseGeneral_0/kernel" in muon_optax.path_str(path)
        else None, p)
    tx = muon_optax.muon_adamw(GROUPS, labels, dimension_numbers=dims)
    rows = {r["path"]: r for r in muon_optax.describe(tx, params, file=None)}
    assert rows["ScanBlock_0/DenseGeneral_0/kernel"]["matrix"] == (32, 32)
    with pytest.raises(TypeError, match="chain"):
        muon_optax.describe(jax.tree_util.Partial(print), params)
