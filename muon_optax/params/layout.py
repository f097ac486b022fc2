"""How Muon sees a parameter: matrices of ``R`` rows = output features by ``C`` columns = input
features, and the stacks they join (static). A block split reshapes a cut axis ``n`` into
``(blocks, n / blocks)``, the first a batch axis: a :class:`MatrixLeaf` is this *block view*. A
matrix is stored in its leaf's axis order (a Flax ``(in, out)`` kernel as ``(C, R)``: a reshape,
where a transpose would be a copy on TPU) or, ``wide``, long side last (an MLP's two matrices
then share a stack); steps that do not commute with transposition read a per-matrix flag."""

from __future__ import annotations

import dataclasses
import itertools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.params.dimension_numbers import (
    MuonDimensionNumbers,
    block_counts,
    is_dimension_numbers,
)
from muon_optax.params.labels import attention_dimension_numbers
from muon_optax.params.variables import unbox, unboxed_structure

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
    """A Muon parameter leaf's block view as ``batch`` matrices of ``rows x cols`` (out x
    in); axes are numbered in the block view."""

    index: int                  # position among all param leaves (flattening order)
    path: str
    shape: tuple[int, ...]      # the block view's shape (the leaf's without blocks)
    dtype: Any
    group: str
    batch_axes: tuple[int, ...]
    out_axes: tuple[int, ...]
    in_axes: tuple[int, ...]
    batch: int
    rows: int
    cols: int
    leaf_shape: tuple[int, ...]
    splits: tuple[tuple[int, int], ...]   # (leaf axis, block size along it)
    blocks: tuple[int, int]               # (output_blocks, reduction_blocks): out x in
    wide: bool = False                    # stored long side last (the plan sets it)

    def view(self, x: jax.Array) -> jax.Array:
        """The block view of a leaf-shaped array (or of one device's block of it, split on
        block boundaries): each cut axis ``n`` becomes ``(n / block size, block size)``."""
        inner_of, shape = dict(self.splits), []
        for a, n in enumerate(x.shape):
            shape += [n // inner_of[a], inner_of[a]] if a in inner_of else [n]
        return x.reshape(shape)

    def view_spec(self, spec: tuple[tuple[str, ...], ...],
                  sizes: dict[str, int]) -> tuple[tuple[str, ...], ...]:
        """The leaf's layout (mesh axes per leaf axis) as a layout of its block view: a cut
        axis split into whole blocks splits the block axis. Raises ``NotImplementedError``
        for a split that cuts blocks (the engine then gathers the leaf whole first)."""
        inner_of, out = dict(self.splits), []
        for a, entry in enumerate(spec):
            outer = self.leaf_shape[a] // inner_of.get(a, 1)
            if a in inner_of and outer % math.prod(sizes[name] for name in entry):
                raise NotImplementedError(
                    f"its axis {a} is split over {entry}, which cuts its {outer} blocks")
            out += [entry, ()] if a in inner_of else [entry]
        return tuple(out)

    @property
    def transposed(self) -> bool:
        """Stored as the transpose ``(cols, rows)``: laid out (in, out), inputs first; or,
        ``wide``, where that puts the long side last (a square as laid out)."""
        if self.wide and self.rows != self.cols:
            return self.cols < self.rows
        return min(self.in_axes) < min(self.out_axes)

    @property
    def stored_shape(self) -> tuple[int, int]:
        return (self.cols, self.rows) if self.transposed else (self.rows, self.cols)

    @property
    def matrix_axes(self) -> tuple[int, ...]:
        """The leaf's non-batch axes, in leaf order."""
        return tuple(sorted(self.out_axes + self.in_axes))

    def split_batch(self, x: jax.Array) -> jax.Array:
        """``(batch, *matrix axes)`` view of a leaf-shaped array (or a block of one)."""
        perm = self.batch_axes + self.matrix_axes
        return jnp.transpose(x, perm).reshape((-1,) + tuple(x.shape[a] for a in self.matrix_axes))

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
        sides = self.sides
        z = z.reshape((z.shape[0],) + tuple(self.shape[self.matrix_axes[a]] for a in sides))
        return jnp.transpose(z, (0,) + tuple(1 + a for a in np.argsort(sides)))

    @property
    def stored_perm(self) -> tuple[int, ...]:
        """Leaf axes in stored order: batch, then stored rows, then stored columns."""
        return self.batch_axes + tuple(self.matrix_axes[i] for i in self.sides)

    def to_stored(self, x: jax.Array) -> jax.Array:
        """``(batch, R, C)`` stored view of a leaf-shaped array, or of a block of one
        split along its batch axes (a transpose only where the axes are not in order)."""
        return jnp.transpose(x, self.stored_perm).reshape((-1,) + self.stored_shape)

    def from_stored(self, y: jax.Array, shape: Sequence[int] | None = None) -> jax.Array:
        """Inverse of :meth:`to_stored`, to the leaf (or a batch block of ``shape``)."""
        shape = self.shape if shape is None else shape
        permuted_shape = tuple(shape[a] for a in self.stored_perm)
        return jnp.transpose(y.reshape(permuted_shape), np.argsort(self.stored_perm))


def _cut(side: tuple[int, ...], shape: tuple[int, ...], blocks: Any, name: str,
         path: str) -> tuple[list[int], dict[int, int]]:
    """How ``blocks`` equal blocks cut a side (its axes in flattening order): the axes
    that become block axes whole, and the axis split as ``(outer, n / outer)``."""
    total = math.prod(shape[a] for a in side)
    if isinstance(blocks, bool) or not isinstance(blocks, (int, np.integer)) or blocks < 1:
        raise ValueError(f"parameter {path!r}: {name} must be a positive int, got "
                         f"{blocks!r}. Fix its MuonDimensionNumbers.")
    sizes = tuple(shape[a] for a in side)
    if total % blocks:
        raise ValueError(
            f"parameter {path!r} of shape {shape}: {name}={blocks} does not divide its side "
            f"of {total} (axes {side}, sizes {sizes}); blocks are equal. Use a count that "
            f"divides {total}, e.g. the number of heads.")
    whole, split, q = [], {}, int(blocks)
    for i, a in enumerate(side):
        if q == 1:
            break
        n = shape[a]
        if q % n == 0 and (q > n or i + 1 < len(side)):
            whole.append(a)
            q //= n
        elif n % q == 0:
            split[a], q = q, 1
        else:
            raise ValueError(
                f"parameter {path!r} of shape {shape}: {name}={blocks} cuts axis {a} "
                f"(size {n}) of its side {side} (sizes {sizes}, flattened in that order) "
                "across blocks unevenly: blocks must end on that axis's boundaries. Use a "
                "count made of whole leading axes times a divisor of the next one.")
    return whole, split


def matrix_leaf(index: int, path: str, leaf: Any, group: str,
                dims: MuonDimensionNumbers | None) -> MatrixLeaf:
    """Checks a Muon leaf and its dimension numbers; raises naming the path."""
    shape = tuple(leaf.shape)
    if len(shape) < 2:
        raise ValueError(
            f"parameter {path!r} has shape {shape} but is labelled for Muon group {group!r}; "
            "Muon needs a matrix (2 or more axes). Give scalars and vectors to an AdamW group.")
    dims = DEFAULT_DIMENSION_NUMBERS if dims is None else dims
    if not is_dimension_numbers(dims):
        raise TypeError(f"parameter {path!r}: dimension_numbers must hold "
                        f"MuonDimensionNumbers, got {dims!r}.")
    red = _axes(dims.reduction_axis, len(shape), "reduction_axis", path)
    out = _axes(dims.output_axis, len(shape), "output_axis", path)
    if len(set(red + out)) != len(red) + len(out):
        raise ValueError(f"parameter {path!r}: reduction_axis {red} and output_axis {out} "
                         "must be distinct axes.")
    if 0 in shape:
        raise ValueError(f"parameter {path!r} has shape {shape} with an empty axis; "
                         "Muon cannot orthogonalize an empty matrix.")
    red_blocks, out_blocks = block_counts(dims)
    whole_r, split_r = _cut(red, shape, red_blocks, "reduction_blocks", path)
    whole_o, split_o = _cut(out, shape, out_blocks, "output_blocks", path)
    split = {**split_r, **split_o}
    at: dict[int, tuple[int, ...]] = {}   # each leaf axis's axes in the block view
    vshape: list[int] = []
    for a, n in enumerate(shape):
        parts = [split[a], n // split[a]] if a in split else [n]
        at[a] = tuple(range(len(vshape), len(vshape) + len(parts)))
        vshape += parts
    blocked = set(whole_r + whole_o) | set(split)
    batch_axes = tuple(at[a][0] for a in range(len(shape)) if a not in red + out or a in blocked)
    red_v = tuple(at[a][-1] for a in red if a not in whole_r)
    out_v = tuple(at[a][-1] for a in out if a not in whole_o)
    batch, rows, cols = (math.prod(vshape[a] for a in axes) for axes in (batch_axes, out_v, red_v))
    return MatrixLeaf(index=index, path=path, shape=tuple(vshape), dtype=jnp.dtype(leaf.dtype),
                      group=group, batch_axes=batch_axes, out_axes=out_v, in_axes=red_v,
                      batch=batch, rows=rows, cols=cols, leaf_shape=shape,
                      blocks=(int(out_blocks), int(red_blocks)),
                      splits=tuple((a, shape[a] // split[a]) for a in sorted(split)))


def flat_dimension_numbers(dimension_numbers: Any, params: Any, paths: Sequence[str],
                           leaves: Sequence[Any]) -> list[Any]:
    """Per-leaf ``MuonDimensionNumbers`` of the flat ``params``; None where the default is
    ``(in, out)`` = the last two axes. The default reads Flax's attention kernels as one
    matrix each (:func:`muon_optax.params.labels.attention_dimension_numbers`)."""
    if is_dimension_numbers(dimension_numbers):
        return [dimension_numbers] * len(leaves)
    dims = [None] * len(leaves)
    if dimension_numbers is not None:
        tree = dimension_numbers(params) if callable(dimension_numbers) else dimension_numbers
        treedef = unboxed_structure(params)
        try:
            dims = treedef.flatten_up_to(unbox(tree))
        except (ValueError, TypeError) as e:
            raise ValueError(
                "dimension_numbers must be one MuonDimensionNumbers, or a tree with the "
                "params' structure holding MuonDimensionNumbers (or None) at every leaf, or "
                f"a callable params -> such a tree. Params: {treedef}.") from e
    defaults = attention_dimension_numbers(paths, [tuple(x.shape) for x in leaves])
    return [defaults.get(i) if d is None else d for i, d in enumerate(dims)]


def normuon_reduces_rows(rows: int, cols: int, transposed: bool) -> bool:
    """Whether NorMuon averages a stored ``rows x cols`` matrix over its stored rows: the short
    side, however stored; a square, its own columns (its stored rows where stored transposed)."""
    return rows < cols if rows != cols else transposed


@dataclasses.dataclass(frozen=True)
class Stack:
    """Matrices updated by one batched program: its members' matrices in member order
    (each ``batch`` of them, row-major)."""

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
        return normuon_reduces_rows(self.rows, self.cols, self.members[0].transposed)

    def stack(self, leaves: Sequence[jax.Array]) -> jax.Array:
        """Stacks the members' leaves (in member order) as ``(K, R, C)``."""
        parts = [m.to_stored(x) for m, x in zip(self.members, leaves)]
        return jnp.concatenate(parts) if len(parts) > 1 else parts[0]

    def unstack(self, stacked: jax.Array) -> list[jax.Array]:
        """Members' leaf-shaped arrays from a ``(K, R, C)`` stack."""
        ends = itertools.accumulate(m.batch for m in self.members)
        return [m.from_stored(stacked[end - m.batch:end]) for m, end in zip(self.members, ends)]


def plan_stacks(leaves: Sequence[MatrixLeaf], configs: dict[str, Any],
                signature) -> tuple[Stack, ...]:
    """Groups Muon matrices into stacks, in first-seen order; ``signature(leaf)``: what
    else two leaves must share (how they travel between devices)."""
    buckets: dict[tuple, list[MatrixLeaf]] = {}
    for leaf in leaves:
        # Squares of both layouts do not share a stack: NorMuon's axis depends on it.
        square_layout = leaf.transposed if leaf.rows == leaf.cols else None
        key = leaf.stored_shape + (str(leaf.dtype), square_layout,
                                   configs[leaf.group].static_key(), signature(leaf))
        buckets.setdefault(key, []).append(leaf)
    return tuple(Stack(*ms[0].stored_shape, ms[0].dtype, configs[ms[0].group], tuple(ms))
                 for ms in buckets.values())
