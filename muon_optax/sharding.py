"""ZeRO-2 along one mesh axis: who owns what, and the collectives that move it.

nanochat's ``DistMuonAdamW`` shards the optimizer without DDP: reduce-scatter the
gradients, update only the owned share with state for only that share, all-gather the
result. Inside ``jax.shard_map`` the same program runs on every device, so ownership is
by position: device ``d`` owns slots ``[d*S, (d+1)*S)`` of every Muon stack (stacks are
zero-padded to a multiple of N) and the ``d``-th slice of every large AdamW parameter
along one axis (padded when no axis divides). Stacks merge all groups and both
orientations of a shape (see :mod:`muon_optax.layout`), so padding, the only source of
imbalance, is paid once per stored shape instead of once per group and shape.

With ``axis_name=None`` the same code runs with N = 1 and every collective is the
identity: the single-device optimizer is the sharded one on one device.
"""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

try:  # Varying -> Invariant all-gather: lets out_specs=P() hold under check_vma.
    from jax.lax import all_gather_invariant as _gather_invariant
except ImportError:
    try:
        from jax._src.lax.parallel import all_gather_invariant as _gather_invariant
    except ImportError:  # older jax: plain all_gather (then shard_map needs check_vma=False)
        _gather_invariant = jax.lax.all_gather


class Collectives:
    """Mean-reduce, scatter and gather along ``axis_name`` (identity when it is None)."""

    def __init__(self, axis_name: str | None, grads_reduced: bool = False):
        self.axis_name = axis_name
        try:
            self.size = 1 if axis_name is None else jax.lax.axis_size(axis_name)
        except NameError as e:
            raise ValueError(
                f"this transformation shards over the mesh axis {axis_name!r}: call its init "
                f"and update inside jax.shard_map over a mesh with that axis, or build it "
                f"with mesh=... (plain jit) or without axis_name (one device).") from e
        # On a one-device axis the collectives still run: they turn the per-device
        # ("varying") gradients into replicated values (single-participant ops).
        self.active = axis_name is not None
        # Under plain jit the gradients arrive already averaged (XLA reduced them in
        # the backward pass): then "reduce" means "take my share".
        self.grads_reduced = grads_reduced

    def index(self) -> jax.Array | int:
        return 0 if self.size == 1 else jax.lax.axis_index(self.axis_name)

    def mean(self, x: jax.Array) -> jax.Array:
        """All-reduce (mean): the small params' gradients."""
        if not self.active or self.grads_reduced:
            return x
        return (jax.lax.psum(x, self.axis_name) / self.size).astype(x.dtype)

    def mean_scatter(self, x: jax.Array, axis: int) -> jax.Array:
        """Reduce-scatter (mean): this device's 1/N of ``x`` along ``axis``."""
        if not self.active:
            return x
        if self.grads_reduced:
            return self.local(x, axis)
        y = jax.lax.psum_scatter(x, self.axis_name, scatter_dimension=axis, tiled=True)
        return (y / self.size).astype(x.dtype)

    def gather(self, x: jax.Array, axis: int) -> jax.Array:
        """All-gather: the devices' slices concatenated along ``axis``, the same everywhere.

        The result is marked invariant along the axis (every device holds the same
        value), so a train step may return the params with ``out_specs=P()``.
        """
        if not self.active:
            return x
        return _gather_invariant(x, self.axis_name, axis=axis, tiled=True)

    def local(self, x: jax.Array | np.ndarray, axis: int = 0) -> jax.Array:
        """This device's 1/N slice of a replicated array along ``axis`` (no communication)."""
        if self.size == 1:
            return jnp.asarray(x)
        n = x.shape[axis] // self.size
        return jax.lax.dynamic_slice_in_dim(jnp.asarray(x), self.index() * n, n, axis)


def adamw_shard_axis(shape: tuple[int, ...], num_devices: int, threshold: int) -> int | None:
    """The axis along which a large AdamW parameter is split, or None (replicated).

    Parameters under ``threshold`` elements are all-reduced and updated everywhere.
    Otherwise the axis that needs the least zero padding to a multiple of N, the leading
    one among equals: a split of the leading axis is a contiguous slice, where a minor
    axis would make XLA transpose the whole gradient first.
    """
    if math.prod(shape) < threshold or not shape:
        return None
    padding = [-(-n // num_devices) * num_devices - n for n in shape]
    return min(range(len(shape)), key=lambda a: (padding[a] * math.prod(shape) // shape[a], a))


def padded_shape(shape: tuple[int, ...], axis: int | None, num_devices: int) -> tuple[int, ...]:
    if axis is None:
        return tuple(shape)
    out = list(shape)
    out[axis] = -(-shape[axis] // num_devices) * num_devices
    return tuple(out)


def pad_to(x: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    if tuple(x.shape) == tuple(shape):
        return x
    return jnp.pad(x, [(0, t - s) for s, t in zip(x.shape, shape)])


def spec(axis: int | None, axis_name: str | None) -> P:
    """PartitionSpec of an array split along ``axis`` over ``axis_name`` (None: replicated)."""
    if axis is None or axis_name is None:
        return P()
    return P(*([None] * axis), axis_name)


def state_specs(tx: Any, params: Any, mesh: jax.sharding.Mesh) -> Any:
    """PartitionSpecs of ``tx``'s state for ``jax.shard_map``'s ``in_specs``/``out_specs``.

    ``tx`` is a transformation from :func:`muon_optax.muon_adamw` (or ``muon``/``adamw``)
    built with an ``axis_name``; ``params`` the full params (arrays or shape structs).
    Sharded leaves get ``P(axis_name)`` on their split axis, the rest ``P()``::

        specs = muon_optax.state_specs(tx, params, mesh)
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                      out_specs=specs))(params)
    """
    specs_fn = getattr(tx.init, "state_specs", None)
    if specs_fn is None:
        raise TypeError("state_specs needs the transformation returned by "
                        "muon_optax.muon_adamw (or muon/adamw) itself, not a chain or a "
                        "wrapper around it; give the wrapper's own state P().")
    return specs_fn(params, mesh)
