"""A transport buffer's element order (muon_optax.step.rows.flat / shaped): on TPU each
matrix in its tiles' order, elsewhere row-major; either way ``shaped`` undoes ``flat``;
and the rows of cut buffers in whole tiles (``lanes``) where every cut allows."""

import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax.rule import platform
from muon_optax.step.rows import flat, lane_of, lanes, shaped, span


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


def test_lanes_only_where_every_cut_is_whole_tiles():
    """A device-major buffer's rows go in units of one tile (8 x 128 of a 32-bit type,
    16 x 128 of a 16-bit one) only where every size and offset is whole units."""
    offsets = np.array([[0, 2048], [1024, 4096]])
    assert lane_of(jnp.float32, 4096, offsets, [1024, 3072]) == 1024
    assert lane_of(jnp.bfloat16, 4096, [2048, 6144]) == 2048
    assert lane_of(jnp.bfloat16, 4096, offsets) == 1           # 1024 is half a 16-bit tile
    assert lane_of(jnp.float32, 4096, offsets, [1536]) == 1
    assert lane_of(jnp.int8, 4096) == 1


def test_lanes_keep_each_row_in_order_and_span_reads_them_as_the_rows():
    """``lanes`` only regroups a row's elements (the same order), and ``span`` reads a
    device's elements across pieces alike from rows and from lanes."""
    n, width, lane = 4, 3072, 1024
    rng = np.random.default_rng(1)
    rows = jnp.asarray(rng.standard_normal((n, 3 * width)), jnp.float32)
    bounds = [(c, c + width) for c in range(0, 3 * width, width)]
    got = [rows[:, c0:c1] for c0, c1 in bounds]
    in_lanes = [lanes(x, lane) for x in got]
    assert in_lanes[0].shape == (n, width // lane, 8, 128)
    np.testing.assert_array_equal(in_lanes[0].reshape(n, -1), got[0])
    assert lanes(got[0], 1) is got[0]
    for d, at, size in [(0, 0, 2048), (3, 2048, 4096), (1, 5120, 4096), (2, 0, 9216)]:
        want = rows[d, at:at + size]
        np.testing.assert_array_equal(span(got, bounds, d, at, size), want)
        np.testing.assert_array_equal(span(in_lanes, bounds, d, at, size, lane).reshape(-1),
                                      want)
