"""A transport buffer's element order (muon_optax.step.rows.flat / shaped): on TPU each
matrix in its tiles' order, elsewhere row-major; either way ``shaped`` undoes ``flat``."""

import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax.rule import platform
from muon_optax.step.rows import flat, shaped


def _tile_order(x: np.ndarray) -> np.ndarray:
    """The TPU's order of each (8, 128)-tiled matrix of ``x`` (..., R, C), written out:
    tile rows top to bottom, tiles left to right in each, a tile's rows in order."""
    *lead, r, c = x.shape
    out = [x[..., i:i + 8, j:j + 128].reshape(tuple(lead) + (-1,))
           for i in range(0, r, 8) for j in range(0, c, 128)]
    return np.concatenate(out, axis=-1).reshape(-1)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.bfloat16])
def test_tile_order_on_tpu_row_major_elsewhere(monkeypatch, dtype):
    x = jnp.asarray(np.random.default_rng(0).standard_normal((3, 16, 256)), dtype)
    np.testing.assert_array_equal(flat(x), x.reshape(-1))           # XLA:CPU's form
    np.testing.assert_array_equal(shaped(flat(x), x.shape), x)
    monkeypatch.setitem(platform.FORCED, "tiles", "tpu")
    np.testing.assert_array_equal(
        flat(x), _tile_order(np.asarray(x, np.float32)).astype(x.dtype))
    assert not np.array_equal(flat(x), x.reshape(-1))
    np.testing.assert_array_equal(shaped(flat(x), x.shape), x)
    np.testing.assert_array_equal(shaped(flat(x).reshape(3, -1), x.shape), x)


@pytest.mark.parametrize("shape, item", [((16, 100), 2), ((12, 256), 2), ((4, 256), 1),
                                         ((2, 8, 128), 1)])
def test_untiled_items_stay_row_major(monkeypatch, shape, item):
    """Matrices not made of whole tiles, and 1-D items, keep row-major order (and an
    item's leading axes never join a tile)."""
    monkeypatch.setitem(platform.FORCED, "tiles", "tpu")
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    np.testing.assert_array_equal(flat(x, item), x.reshape(-1))
    np.testing.assert_array_equal(shaped(x.reshape(-1), shape, item), x)
