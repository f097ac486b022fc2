"""How a Muon matrix reaches its owner depends on how its leaf is laid out over the owner axes
(its *transport*):

- ``"gather"``: the leaf is whole on every device (replicated params, ZeRO-2). The owner
  takes its matrices from one reduce-scatter of a flat, device-major buffer of every
  device's gradients (or from its own copy, when the gradients arrive already reduced),
  and the directions go back to every device by one all-gather of that buffer.
- ``"exchange"``: the leaf's matrix axes are split over the owner axes (FSDP, tensor
  parallel, both). Every holder sends its owner an equal piece of the matrix, so one
  all-to-all assembles every matrix on its owner; a second all-to-all sends each holder
  its block of the direction.
- ``"local"``: the leaf is split along its batch (layer) axes over all owner axes: each
  device owns the matrices it holds, and nothing moves.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from muon_optax.params.layout import MatrixLeaf

GATHER, EXCHANGE, LOCAL = "gather", "exchange", "local"


@dataclasses.dataclass(frozen=True)
class Route:
    """How an ``"exchange"`` leaf's matrix axes are split over the owner axes.

    ``grid[i]`` blocks along matrix axis ``i`` (the leaf's non-batch axes in leaf order);
    ``replicas`` devices hold each block. Source device ``s`` (its linear index over the
    owner axes) holds block ``block_of[s]`` and sends its owner sub-piece
    ``replica_of[s]`` of it, ``piece`` elements, so every source sends the same amount.
    """

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
    coords = {}
    for name, size in reversed(axes):
        coords[name] = d % size
        d //= size
    return coords


def _linear(coords: dict[str, int], names: Sequence[str], sizes: dict[str, int]) -> int:
    i = 0
    for name in names:
        i = i * sizes[name] + coords[name]
    return i


def classify(leaf: MatrixLeaf, spec: tuple[tuple[str, ...], ...],
             axes: Sequence[tuple[str, int]]) -> tuple[str, Route | None]:
    """The transport of a Muon leaf laid out as ``spec`` (mesh axes per leaf axis).

    Raises ``NotImplementedError`` for layouts this module does not move (both the batch
    axes and the matrix axes split, or batch axes split over only some owner axes); the
    engine then gathers such a leaf whole first.
    """
    sizes = dict(axes)
    n = math.prod(sizes.values())
    batch_split = [a for i in leaf.batch_axes for a in spec[i]]
    matrix_axes = leaf.matrix_axes
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
    used = set(matrix_split)
    replica_axes = [name for name, _ in axes if name not in used]
    block_of, replica_of = [], []
    for d in range(n):
        coords = device_coords(d, axes)
        index = 0
        for i, g in zip(matrix_axes, grid):
            index = index * g + _linear(coords, spec[i], sizes)
        block_of.append(index)
        replica_of.append(_linear(coords, replica_axes, sizes))
    mshape = tuple(leaf.shape[i] for i in matrix_axes)
    return EXCHANGE, Route(mshape, grid, n // math.prod(grid), tuple(block_of),
                           tuple(replica_of))


def local_holders(leaf: MatrixLeaf, spec: tuple[tuple[str, ...], ...],
                  axes: Sequence[tuple[str, int]]) -> tuple[np.ndarray, list[list[int]]]:
    """For a ``"local"`` leaf: the device holding each matrix (batch index, row-major
    over the batch axes), and each device's matrices in its local row-major order."""
    sizes = dict(axes)
    n = math.prod(sizes.values())
    bshape = [leaf.shape[i] for i in leaf.batch_axes]
    grid = [math.prod(sizes[a] for a in spec[i]) for i in leaf.batch_axes]
    holder = np.zeros(leaf.batch, np.int64)
    held: list[list[int]] = [[] for _ in range(n)]
    for d in range(n):
        coords = device_coords(d, axes)
        ranges = []
        for i, size, g in zip(leaf.batch_axes, bshape, grid):
            block = _linear(coords, spec[i], sizes)
            ranges.append(range(block * (size // g), (block + 1) * (size // g)))
        for idx in np.ndindex(*[len(r) for r in ranges]):
            b = int(np.ravel_multi_index([r[k] for r, k in zip(ranges, idx)], bshape))
            holder[b] = d
            held[d].append(b)
    return holder, held
