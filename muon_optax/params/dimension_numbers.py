"""Which axes of a parameter are Muon's matrix sides, and into how many blocks each is cut
(per-head Muon, Group Muon, fused QKV or gate/up: every block is one Muon matrix). Experts
``(E, in, out)`` need no blocks: ``E`` is a batch axis."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import optax.contrib


class MuonDimensionNumbers(NamedTuple):
    """Matrix axes of a Muon parameter, and how many blocks each side is cut into.

    Attributes:
      reduction_axis: the input axis (or axes) of ``x @ W``: the matrix's columns.
      output_axis: the output axis (or axes): the matrix's rows. Other axes are batch
        axes (layers, experts): each index is a matrix of its own.
      reduction_blocks: blocks along the input side (``heads`` for an attention output
        projection ``(heads * head_dim, d)``: one matrix per head).
      output_blocks: blocks along the output side (``heads`` for per-head ``c_q``,
        ``heads // group`` for Group Muon, ``3`` for a fused QKV, ``2`` for gate/up).

    ``optax.contrib.MuonDimensionNumbers`` is accepted wherever this is, as one block.
    """

    reduction_axis: Sequence[int] | int = 0
    output_axis: Sequence[int] | int = 1
    reduction_blocks: int = 1
    output_blocks: int = 1


def is_dimension_numbers(x: Any) -> bool:
    """Ours or optax's dimension numbers."""
    return isinstance(x, (MuonDimensionNumbers, optax.contrib.MuonDimensionNumbers))


def block_counts(dims: Any) -> tuple[int, int]:
    """``(reduction_blocks, output_blocks)``; ``(1, 1)`` for optax's dimension numbers."""
    return (getattr(dims, "reduction_blocks", 1), getattr(dims, "output_blocks", 1))


def check_unused(dims: Any, path: str, group: str) -> None:
    """Raises naming the path if dimension numbers given for a leaf of AdamW group ``group``
    (unused) are wrong in themselves: the caller meant something else."""
    if dims is None:
        return
    where = (f"parameter {path!r} is in AdamW group {group!r}, which does not use its "
             "dimension numbers, but they are invalid")
    if not is_dimension_numbers(dims):
        raise TypeError(f"{where}: expected MuonDimensionNumbers or None, got {dims!r}.")
    for name, n in zip(("reduction_blocks", "output_blocks"), block_counts(dims)):
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"{where}: {name} must be a positive int, got {n!r}. Fix "
                             "them, or give None for this leaf.")
    axes = [(a,) if isinstance(a, int) else tuple(a)
            for a in (dims.reduction_axis, dims.output_axis)]
    if set(axes[0]) & set(axes[1]):
        raise ValueError(f"{where}: reduction_axis {dims.reduction_axis} and output_axis "
                         f"{dims.output_axis} share an axis. Fix them, or give None for "
                         "this leaf (or label it for a Muon group if it is a matrix).")
