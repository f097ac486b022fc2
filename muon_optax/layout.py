"""How Muon sees a parameter: matrices, their orientation, and the stacks they join.

Everything here is static: it is computed in Python from shapes, dtypes and labels at
trace time, and only decides which slices, transposes and concatenations the traced
program does.

Orientation. The rule is written for a matrix with ``R`` rows = output features and
``C`` columns = input features (PyTorch's ``(out, in)``). A leaf of any rank is mapped
to a batch of such matrices with ``MuonDimensionNumbers`` (``reduction_axis`` = input
axes, ``output_axis`` = output axes, all other axes batch). Default: the last two axes
are ``(in, out)``, the Flax ``Dense`` layout, and leading axes (a scanned layer stack)
are batch axes.

Stacks. A tall matrix (``R > C``) is stored transposed, as its ``(C, R)`` wide
transpose: the polar iteration commutes with transposition, and the steps that do not
(row equilibration, NorMuon's axis, the aspect-ratio factor) read a per-matrix flag.
A square matrix is stored the way its leaf lays it out, so a Flax ``(in, out)`` kernel
is stored transposed and needs no copy. So every matrix is stored wide or square, and
all matrices with the same stored shape, dtype and static options form one stack
``(K, R, C)`` updated by one batched program, across groups and orientations: an MLP's
``c_fc`` and ``c_proj`` share a stack.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from optax.contrib import MuonDimensionNumbers

from muon_optax.labels import attention_dimension_numbers, path_str
from muon_optax.variables import unbox, unboxed_structure

DEFAULT_DIMENSION_NUMBERS = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)


def _axes(value: Any, ndim: int, name: str, path: str) -> tuple[int, ...]:
    axes = (value,) if isinstance(value, int) else tuple(value)
    if not axes or not all(isinstance(a, int) for a in axes):
        raise TypeError(f"parameter {path!r}: {name} must be an int or a non-empty sequence "
                        f"of ints, got {value!r}.")
    if not all(-ndim <= a < ndim for a in axes):
        raise ValueError(f"parameter {path!r} has {ndim} axes; {name}={value!r} is out of "
                         "range. Fix its MuonDimensionNumbers.")
    return tuple(a % ndim for a in axes)


@dataclasses.dataclass(frozen=True)
class MatrixLeaf:
    """A Muon parameter leaf seen as ``batch`` matrices of ``rows x cols`` (out x in)."""

    index: int                  # position among all param leaves (flattening order)
    path: str
    shape: tuple[int, ...]
    dtype: Any
    group: str
    batch_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    in_axes: tuple[int, ...]
    batch: int
    rows: int
    cols: int

    @property
    def transposed(self) -> bool:
        """Stored as the transpose ``(cols, rows)``: tall, or square laid out (in, out)."""
        inputs_first = min(self.in_axes) < min(self.out_axes)
        return self.rows > self.cols or (self.rows == self.cols and inputs_first)

    @property
    def stored_shape(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    @property
    def matrix_axes(self) -> tuple[int, ...]:
        """The leaf's non-batch axes, in leaf order."""
        return tuple(sorted(self.out_axes + self.in_axes))

    def split_batch(self, x: jax.Array) -> jax.Array:
        """``(batch, *matrix axes)`` view of a leaf-shaped array, or of a block of one
        (any sizes): batch axes first, flattened; matrix axes in leaf order."""
        perm = self.batch_axes + self.matrix_axes
        return jnp.transpose(x, perm).reshape((-1,) + tuple(x.shape[a] for a in
                                                            self.matrix_axes))

    def join_batch(self, y: jax.Array, shape: Sequence[int]) -> jax.Array:
        """Inverse of :meth:`split_batch`, back to a leaf (or block) of ``shape``."""
        perm = self.batch_axes + self.matrix_axes
        y = y.reshape(tuple(shape[a] for a in perm))
        return jnp.transpose(y, np.argsort(perm))

    @property
    def sides(self) -> tuple[int, ...]:
        """Positions, among the matrix axes, of the stored rows' then columns' axes."""
        sides = self.in_axes + self.out_axes if self.transposed else self.out_axes + self.in_axes
        return tuple(self.matrix_axes.index(a) for a in sides)

    def matrix_to_stored(self, y: jax.Array) -> jax.Array:
        """``(n, *matrix axes)`` (whole matrices, leaf order) -> stored ``(n, R, C)``."""
        perm = (0,) + tuple(1 + a for a in self.sides)
        return jnp.transpose(y, perm).reshape((y.shape[0],) + self.stored_shape)

    def stored_to_matrix(self, z: jax.Array) -> jax.Array:
        """Inverse of :meth:`matrix_to_stored`."""
        mshape = tuple(self.shape[a] for a in self.matrix_axes)
        sides = self.sides
        z = z.reshape((z.shape[0],) + tuple(mshape[a] for a in sides))
        return jnp.transpose(z, (0,) + tuple(1 + a for a in np.argsort(sides)))

    @property
    def stored_perm(self) -> tuple[int, ...]:
        """Leaf axes in stored order: batch, then stored rows, then stored columns."""
        return self.batch_axes + tuple(self.matrix_axes[i] for i in self.sides)

    def to_stored(self, x: jax.Array) -> jax.Array:
        """``(batch, R, C)`` stored view of a leaf-shaped array, or of a block of one
        split along its batch axes (wide or square)."""
        # One transpose (none at all for a Flax kernel stored as laid out), then a reshape.
        return jnp.transpose(x, self.stored_perm).reshape((-1,) + self.stored_shape)

    def from_stored(self, y: jax.Array, shape: Sequence[int] | None = None) -> jax.Array:
        """Inverse of :meth:`to_stored`, to the leaf (or a batch block of ``shape``)."""
        shape = self.shape if shape is None else shape
        permuted_shape = tuple(shape[a] for a in self.stored_perm)
        return jnp.transpose(y.reshape(permuted_shape), np.argsort(self.stored_perm))


def matrix_leaf(index: int, path: str, leaf: Any, group: str,
                dims: MuonDimensionNumbers | None) -> MatrixLeaf:
    """Checks a Muon leaf and its dimension numbers; raises naming the path."""
    shape = tuple(leaf.shape)
    if len(shape) < 2:
        raise ValueError(
            f"parameter {path!r} has shape {shape} but is labelled for Muon group {group!r}; "
            "Muon needs a matrix (2 or more axes). Give scalars and vectors to an AdamW "
            "group.")
    dims = DEFAULT_DIMENSION_NUMBERS if dims is None else dims
    if not isinstance(dims, MuonDimensionNumbers):
        raise TypeError(f"parameter {path!r}: dimension_numbers must hold "
                        f"MuonDimensionNumbers, got {dims!r}.")
    red = _axes(dims.reduction_axis, len(shape), "reduction_axis", path)
    out = _axes(dims.output_axis, len(shape), "output_axis", path)
    if len(set(red + out)) != len(red) + len(out):
        raise ValueError(f"parameter {path!r}: reduction_axis {red} and output_axis {out} "
                         "must be distinct axes.")
    batch_axes = tuple(a for a in range(len(shape)) if a not in red + out)
    if 0 in shape:
        raise ValueError(f"parameter {path!r} has shape {shape} with an empty axis; "
                         "Muon cannot orthogonalize an empty matrix.")
    size = lambda axes: math.prod(shape[a] for a in axes)  # noqa: E731
    return MatrixLeaf(index=index, path=path, shape=shape, dtype=jnp.dtype(leaf.dtype),
                      group=group, batch_axes=batch_axes, out_axes=out, in_axes=red,
                      batch=size(batch_axes), rows=size(out), cols=size(red))


def flat_dimension_numbers(dimension_numbers: Any, params: Any) -> list[Any]:
    """Per-leaf ``MuonDimensionNumbers`` in flattening order; None where the default is
    ``(in, out)`` = the last two axes. The default reads Flax's attention kernels as one
    matrix each (:func:`muon_optax.labels.attention_dimension_numbers`)."""
    flat, treedef = jax.tree_util.tree_flatten_with_path(params)
    if isinstance(dimension_numbers, MuonDimensionNumbers):
        return [dimension_numbers] * treedef.num_leaves
    if dimension_numbers is None:
        dims = [None] * treedef.num_leaves
    else:
        tree = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        try:
            dims = unboxed_structure(params).flatten_up_to(unbox(tree))
        except (ValueError, TypeError) as e:
            raise ValueError(
                "dimension_numbers must be one MuonDimensionNumbers, or a tree with the "
                "params' structure holding MuonDimensionNumbers (or None) at every leaf, or "
                f"a callable params -> such a tree. Params: {treedef}.") from e
    defaults = attention_dimension_numbers([path_str(p) for p, _ in flat],
                                           [tuple(getattr(x, "shape", ())) for _, x in flat])
    return [defaults.get(i) if d is None else d for i, d in enumerate(dims)]


@dataclasses.dataclass(frozen=True)
class Stack:
    """Matrices updated by one batched program: same stored shape, dtype and options.

    The stack's matrices are its members' matrices in member order (a leaf with batch
    axes contributes ``batch`` of them, in row-major batch order); :mod:`muon_optax.plan`
    decides which device owns each.
    """

    rows: int
    cols: int
    dtype: Any
    config: Any                 # the MuonConfig whose static options the stack runs with
    members: tuple[MatrixLeaf, ...]

    @property
    def size(self) -> int:
        return sum(m.batch for m in self.members)

    @property
    def reduces_rows(self) -> bool:
        """NorMuon's averaging axis is the stored rows (see ``muon.normuon_axis``)."""
        return self.rows < self.cols or self.members[0].transposed

    def matrices(self) -> list[tuple[int, int]]:
        """``(member, batch index)`` of every matrix, in stack order."""
        return [(i, b) for i, m in enumerate(self.members) for b in range(m.batch)]

    def stack(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """Stacks the members' leaves (in member order) as ``(K, R, C)``."""
        parts = [m.to_stored(x) for m, x in zip(self.members, leaves)]
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def unstack(self, stacked: jax.Array) -> list[jax.Array]:
        """Members' leaf-shaped arrays from a ``(K, R, C)`` stack."""
        out, offset = [], 0
        for m in self.members:
            out.append(m.from_stored(stacked[offset:offset + m.batch]))
            offset += m.batch
        return out


def plan_stacks(leaves: Sequence[MatrixLeaf], configs: dict[str, Any],
                signature=lambda leaf: None) -> tuple[Stack, ...]:
    """Groups Muon matrices into stacks, in first-seen order.

    ``signature(leaf)`` adds what else two leaves must share to be batched together
    (how they travel between devices, see :mod:`muon_optax.plan`).
    """
    buckets: dict[tuple, list[MatrixLeaf]] = {}
    for leaf in leaves:
        # Squares of both layouts do not share a stack: NorMuon's axis depends on it.
        square_layout = leaf.transposed if leaf.rows == leaf.cols else None
        key = leaf.stored_shape + (str(leaf.dtype), square_layout,
                                   configs[leaf.group].static_key(), signature(leaf))
        buckets.setdefault(key, []).append(leaf)
    stacks = []
    for members in buckets.values():
        rows, cols = members[0].stored_shape
        stacks.append(Stack(rows=rows, cols=cols, dtype=members[0].dtype,
                            config=configs[members[0].group], members=tuple(members)))
    return tuple(stacks)
