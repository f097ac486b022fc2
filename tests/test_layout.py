"""How a Muon leaf is stored: as its leaf lays it out, so the stored view is a reshape."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax import MuonDimensionNumbers as MDN
from muon_optax.params.layout import matrix_leaf, normuon_reduces_rows
from muon_optax.rule.muon import normuon_axis


def _ops(fn, x):
    return [e.primitive.name for e in jax.make_jaxpr(fn)(x).jaxpr.eqns]


@pytest.mark.parametrize("shape,dims,transposed,stored", [
    ((64, 256), None, True, (64, 256)),             # Flax c_fc: (in, out)
    ((256, 64), None, True, (256, 64)),             # Flax c_proj: the rule's matrix is wide
    ((3, 256, 64), None, True, (256, 64)),          # a scanned stack of them
    ((64, 256), MDN(1, 0), False, (64, 256)),       # PyTorch's (out, in)
    ((64, 4, 16), MDN(0, (1, 2)), True, (64, 64)),  # attention: (in, heads, head_dim)
])
def test_a_leaf_is_stored_as_laid_out(shape, dims, transposed, stored):
    # On a TPU every transpose is a copy (tiled arrays); a leaf whose matrix axes are
    # adjacent, batch axes first, must reach its stack and come back by reshapes only.
    x = jnp.zeros(shape, jnp.float32)
    m = matrix_leaf(0, "w", x, "g", dims)
    assert m.transposed is transposed
    assert m.stored_shape == stored
    assert "transpose" not in _ops(m.to_stored, x)
    stored = m.to_stored(x)
    assert "transpose" not in _ops(m.from_stored, stored)
    np.testing.assert_array_equal(m.from_stored(stored), x)


@pytest.mark.parametrize("out_in", [(4, 8), (8, 4), (6, 6)])
@pytest.mark.parametrize("transposed", [False, True])
def test_normuon_averages_the_rules_axis_in_either_orientation(out_in, transposed):
    # The rule (nanochat): a wide matrix averages over its rows (one statistic per
    # column), a tall or square one over its columns. Stored transposed, the stored axis
    # is the other one.
    r, c = out_in
    own_axis = -2 if r < c else -1
    rows, cols = (c, r) if transposed else (r, c)
    stored_axis = own_axis if not transposed else (-1 if own_axis == -2 else -2)
    assert normuon_axis(rows, cols, transposed) == stored_axis
    assert normuon_reduces_rows(rows, cols, transposed) == (stored_axis == -2)
