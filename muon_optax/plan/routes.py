"""A Muon leaf's *transport* (``step/transport.py``), from its layout over the owner axes:
``"gather"``, whole on every device (replicated params, ZeRO-2); ``"exchange"``, its matrix
axes split (FSDP, tensor parallel, both): every holder sends the owner an equal piece;
``"local"``, its batch (layer) axes split over all owner axes: nothing moves."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from muon_optax.params.layout import MatrixLeaf

GATHER, EXCHANGE, LOCAL = "gather", "exchange", "local"


@dataclasses.dataclass(frozen=True)
class Route:
    """How an ``"exchange"`` leaf's matrix axes split over the owner axes: ``grid[i]`` blocks
    along matrix axis ``i`` (leaf order), each on ``replicas`` devices. Device ``s`` (linear index)
    holds block ``block_of[s]`` and sends the owner its sub-piece ``replica_of[s]`` (``piece``)."""

    mshape: tuple[int, ...]
    grid: tuple[int, ...]
    replicas: int
    block_of: tuple[int, ...]
    replica_of: tuple[int, ...]

    @property
    def block_shape(self) -> tuple[int, ...]:
        return tuple(n // g for n, g in zip(self.mshape, self.grid))

    @property
    def block_size(self) -> int:
        return math.prod(self.block_shape)

    @property
    def piece(self) -> int:
        return -(-self.block_size // self.replicas)

    @property
    def source_order(self) -> np.ndarray:
        """Source devices sorted by (block, sub-piece): the order that reassembles."""
        return np.argsort(np.asarray(self.block_of) * self.replicas
                          + np.asarray(self.replica_of), kind="stable")


def device_coords(d: int, axes: Sequence[tuple[str, int]]) -> dict[str, int]:
    """Mesh coordinates of owner-axes linear index ``d`` (first axis major)."""
    return dict(zip(dict(axes), map(int, np.unravel_index(d, [size for _, size in axes]))))


def _linear(coords: dict[str, int], names: Sequence[str], sizes: dict[str, int]) -> int:
    i = 0
    for name in names:
        i = i * sizes[name] + coords[name]
    return i


def classify(leaf: MatrixLeaf, spec: tuple[tuple[str, ...], ...],
             axes: Sequence[tuple[str, int]]) -> tuple[str, Route | None]:
    """The transport and route of a Muon leaf laid out as ``spec``. Raises
    ``NotImplementedError`` for a layout it cannot move (the engine then gathers it whole)."""
    sizes = dict(axes)
    n = math.prod(sizes.values())
    matrix_axes = leaf.matrix_axes
    batch_split = [a for i in leaf.batch_axes for a in spec[i]]
    matrix_split = [a for i in matrix_axes for a in spec[i]]
    if not batch_split and not matrix_split:
        return GATHER, None
    if batch_split and matrix_split:
        raise NotImplementedError("both its batch axes and its matrix axes are split")
    if batch_split:
        if math.prod(sizes[a] for a in batch_split) != n:
            raise NotImplementedError("its batch axes are split over only some owner axes")
        return LOCAL, None
    grid = tuple(math.prod(sizes[a] for a in spec[i]) for i in matrix_axes)
    replica_axes = [name for name, _ in axes if name not in matrix_split]
    # Blocks row-major over the matrix axes, each split major first: one number over all.
    coords = [device_coords(d, axes) for d in range(n)]
    block_of = tuple(_linear(c, matrix_split, sizes) for c in coords)
    replica_of = tuple(_linear(c, replica_axes, sizes) for c in coords)
    return EXCHANGE, Route(tuple(leaf.shape[i] for i in matrix_axes), grid,
                           n // math.prod(grid), block_of, replica_of)


def local_holders(leaf: MatrixLeaf, spec: tuple[tuple[str, ...], ...],
                  axes: Sequence[tuple[str, int]]) -> np.ndarray:
    """For a ``"local"`` leaf: the device holding each matrix (row-major over batch axes)."""
    sizes = dict(axes)
    holder = np.zeros([leaf.shape[i] for i in leaf.batch_axes], np.int64)
    for d in range(math.prod(sizes.values())):
        coords, at = device_coords(d, axes), []
        for k, i in enumerate(leaf.batch_axes):
            size = holder.shape[k] // math.prod(sizes[a] for a in spec[i])
            block = _linear(coords, spec[i], sizes)
            at.append(slice(block * size, (block + 1) * size))
        holder[tuple(at)] = d
    return holder.reshape(-1)
