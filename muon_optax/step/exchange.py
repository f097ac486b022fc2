"""The exchange transport (``mesh=``, blocks split over the devices): equal pieces of every
matrix to its owner in an all-to-all, the directions back in another. On TPU both go in column
pieces, each sent just before its first load or once complete, so no one holds every piece at
once; elsewhere each is one all-to-all. Same results, bit for bit."""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.plan.plan import OwnerPlan, StackPlan
from muon_optax.plan.routes import EXCHANGE
from muon_optax.rule.order import after, wait_for
from muon_optax.rule.platform import per_platform
from muon_optax.step import rows
from muon_optax.step.collectives import Collectives, Cost, flat_rows, row_slice


def exchange_piece(owner: OwnerPlan) -> int:
    """Elements of each row in one TPU piece of an all-to-all: half a largest holder's block
    (fewer temporaries than a whole, a quarter or 3/8 of one)."""
    return max([1] + [sp.route.block_size for sp in owner.stacks
                      if sp.transport == EXCHANGE]) // 2 or 1


def _grid_to_matrix(route, x: jax.Array) -> jax.Array:
    """``(n, blocks, block_size)`` (row-major over the grid, each by :func:`flat`) -> matrices."""
    n, g, b = x.shape[0], route.grid, route.block_shape
    x = rows.shaped(x, (n, math.prod(g)) + b, len(b)).reshape((n,) + g + b)
    perm = (0,) + tuple(a for i in range(len(g)) for a in (1 + i, 1 + len(g) + i))
    return jnp.transpose(x, perm).reshape((n,) + route.mshape)


def _matrix_to_grid(route, x: jax.Array) -> jax.Array:
    """Inverse of :func:`_grid_to_matrix`."""
    n, g, b = x.shape[0], route.grid, route.block_shape
    x = x.reshape((n,) + tuple(v for pair in zip(g, b) for v in pair))
    perm = (0,) + tuple(range(1, 2 * len(g), 2)) + tuple(range(2, 2 * len(g) + 1, 2))
    x = jnp.transpose(x, perm).reshape((n, math.prod(g)) + b)
    return rows.flat(x, len(b)).reshape(n, math.prod(g), route.block_size)


def _by_variant(sp: StackPlan, comm: Collectives, j0: int, n: int, fn, axis: int):
    """``fn(member)`` per slot ``j0 .. j0+n`` (along ``axis``) of its layout. Leaves split
    differently (Flax kernels on rows, PyTorch on columns) share a stack: one polar program and
    balance (apart, each might leave a remainder slot, a ``lax.cond``)."""
    reps, table = sp.variants()
    if len(reps) == 1:
        return fn(reps[0])
    mine = jnp.asarray(comm.pick(table))[j0:j0 + n]
    shape = [1] * axis + [n]
    out = fn(reps[0])
    for v, i in enumerate(reps[1:], start=1):
        out = jnp.where((mine == v).reshape(shape + [1] * (out.ndim - axis - 1)), fn(i), out)
    return out


class ExchangeSource:
    """Owned matrices of the ``"exchange"`` stacks of one dtype: each holder of a block sends
    the owner its sub-piece of ``replicas`` equal ones, reassembled by a fixed permutation."""

    def __init__(self, owner: OwnerPlan, dtype: Any, leaves: list[jax.Array], comm: Collectives):
        self.owner, self.comm = owner, comm
        self.channel = owner.exchange[dtype]
        n, length = comm.size, self.channel.length
        self.width = max(1, exchange_piece(owner))
        self.bounds = [(c0, min(length, c0 + self.width))
                       for c0 in range(0, max(length, 1), self.width)]
        routes = [r for k in self.channel.stacks for r in owner.stacks[k].routes]
        self.lane = rows.lane_of(dtype, self.width, length, self.channel.offsets,
                                 [r.piece for r in routes], [r.block_size for r in routes])
        self.members = [m.index for k in self.channel.stacks
                        for m in self.owner.stacks[k].stack.members]
        parts, unflatten = flat_rows(self._parts(leaves))

        def whole(*parts):
            got = comm.exchange(jnp.stack([row_slice(r, 0, length, dtype)
                                           for r in unflatten(parts)]))
            return [jax.lax.slice_in_dim(got, c0, c1, axis=1) for c0, c1 in self.bounds]

        def none_yet(*_):   # TPU: the load that first needs a piece exchanges it
            return [jnp.zeros((n, c1 - c0), dtype) for c0, c1 in self.bounds]

        self.dtype, self.leaves = dtype, [leaves[i] for i in self.members]
        self.piece_leaves = self._piece_leaves()
        self.received = (whole(*parts) if comm.size == 1
                         else per_platform("exchange", *parts, tpu=none_yet, default=whole))

    @staticmethod
    def cost(owner: OwnerPlan, dtype: Any, reduced: bool) -> Cost:
        """An all-to-all of this device's ``(N, length)`` pieces, all but its own row."""
        return Cost((owner.num_devices - 1) * owner.exchange[dtype].length * dtype.itemsize)

    def _parts(self, leaves) -> list[list[jax.Array]]:
        """Per device, the parts of ``leaves`` (a list, or a dict) it is sent."""
        parts: list[list[jax.Array]] = [[] for _ in range(self.comm.size)]
        for k in self.channel.stacks:
            sp = self.owner.stacks[k]
            rows.owned_parts(sp, self._pieces(sp, leaves), parts)
        return parts

    def _piece_leaves(self) -> list[list[int]]:
        """Per piece, the leaves (indices in ``self.members``) its columns are cut from."""
        position = {index: i for i, index in enumerate(self.members)}
        runs = []   # (first column, end, member position), every device's row
        for d in range(self.comm.size):
            at = 0
            for k in self.channel.stacks:
                sp = self.owner.stacks[k]
                row = sp.slots[d]
                for member, lo, hi in rows.member_runs(sp.stack, row[row >= 0]):
                    size = (hi - lo) * sp.routes[member].piece
                    runs.append((at, at + size, position[sp.stack.members[member].index]))
                    at += size
        return [sorted({i for a, b, i in runs if a < c1 and c0 < b}) for c0, c1 in self.bounds]

    def _exchange(self, first: int, last: int, leaves, got: dict, prev) -> dict:
        """Pieces ``first .. last-1`` not yet in ``got``, exchanged (TPU), each packed once
        ``prev`` and the previous piece are in: received just before the load that reads it."""
        got, now = dict(got), dict(zip(self.members, leaves))
        for p in range(first, last):
            if p in got:
                continue
            used = self.piece_leaves[p]   # only the leaves this piece is cut from wait
            held = wait_for([leaves[i] for i in used], got.get(p - 1), prev)
            per_device = self._parts({**now, **{self.members[i]: x for i, x in zip(used, held)}})
            packed = jnp.stack([rows.lanes(row_slice(r, *self.bounds[p], self.dtype), self.lane)
                                for r in per_device])
            got[p] = self.comm.exchange(packed)
        return got

    def _pieces(self, sp: StackPlan, leaves: list[jax.Array]) -> list[jax.Array]:
        """Per member ``(batch, piece)``: this device's sub-piece of each of its matrices."""
        out = []
        for m, route in zip(sp.stack.members, sp.routes):
            blocks = rows.flat(m.split_batch(leaves[m.index]), len(route.block_shape))
            blocks = blocks.reshape(m.batch, route.block_size)
            padded = route.replicas * route.piece
            if padded > route.block_size:
                blocks = jnp.pad(blocks, ((0, 0), (0, padded - route.block_size)))
            blocks = blocks.reshape(m.batch, route.replicas, route.piece)
            j = self.comm.pick(np.asarray(route.replica_of))
            out.append(rows.dynamic_slice(blocks, j, 1, 1)[:, 0])
        return out

    def load(self, got: dict, k: int, j0: int, n: int, prev: jax.Array | None):
        sp = self.owner.stacks[k]
        piece, lane = sp.route.piece, self.lane
        offsets = np.asarray(self.channel.offsets[k]) + j0 * piece
        p0 = int(offsets.min()) // self.width
        p1 = min(len(self.bounds), (int(offsets.max()) + n * piece - 1) // self.width + 1)

        def columns(got, first, lane):  # this device's columns of pieces first, first+1 ..
            cols = jnp.concatenate(got, axis=1) if len(got) > 1 else got[0]
            start = (self.comm.pick(np.asarray(self.channel.offsets[k]) // lane)
                     + (j0 * piece - first * self.width) // lane)   # in `lane` elements
            return rows.dynamic_slice(cols, start, n * piece // lane, 1)

        def whole(received):   # not TPU: the one received buffer
            return rows.lanes(columns(received, 0, 1), lane)

        if self.comm.size == 1:
            raw = whole(self.received)
        else:
            new = [p for p in range(p0, p1) if p not in got]
            have = [p for p in sorted(got) if p0 - 1 <= p < p1]
            nf, nh = len(self.leaves), len(have)

            def tpu(*args):
                leaves, held = args[:nf], args[nf:nf + nh]
                wait = args[-1] if prev is not None else None
                got = self._exchange(p0, p1, leaves, dict(zip(have, held)), wait)
                pieces = wait_for([got[p] for p in range(p0, p1)], wait)
                return (columns(pieces, p0, lane), *[got[p] for p in new])

            def default(*_):
                return (whole(self.received), *[rows.lanes(self.received[p], lane) for p in new])

            wait = prev if prev is not None else jnp.zeros((), self.dtype)
            out = per_platform("exchange", *self.leaves, *[got[p] for p in have], wait,
                                     tpu=tpu, default=default)
            raw, got = out[0], {**got, **dict(zip(new, out[1:]))}
        raw = raw.reshape((self.comm.size, n, piece // lane) + raw.shape[2:])

        def assemble(i):  # the matrices as member i's layout puts them together
            route, member = sp.routes[i], sp.stack.members[i]
            x = rows.take_static(raw, route.source_order)
            x = jnp.transpose(x, (1, 0) + tuple(range(2, x.ndim)))
            x = x.reshape((n, math.prod(route.grid), -1) + x.shape[3:])
            return member.matrix_to_stored(_grid_to_matrix(route, x[:, :, :route.block_size
                                                                        // lane]))

        return _by_variant(sp, self.comm, j0, n, assemble, axis=0), got


class Directions(NamedTuple):
    """An exchange sink's directions so far: the ``(N, length)`` buffer (not TPU); on TPU the
    pieces being written, those sent and the last store's result (the next load waits)."""
    buffer: jax.Array
    parts: dict
    got: dict
    stored: jax.Array | None


class ExchangeSink:
    """Directions of the ``"exchange"`` stacks back to every holder of their blocks: one
    ``(N, length)`` buffer sent after the last stack or, on TPU, each piece once complete."""

    def __init__(self, owner: OwnerPlan, dtype: Any, comm: Collectives):
        self.owner, self.comm, self.dtype = owner, comm, dtype
        self.channel = owner.back[dtype]
        length, width = self.channel.length, max(1, exchange_piece(owner))
        self.bounds = [(c0, min(length, c0 + width)) for c0 in range(0, max(length, 1), width)]
        # Sent in lanes (read by slices), written in them where N rows fill no tile (rows of small
        # tiles: a costly relayout, BENCHMARKS.md), else as (N, width) rows (fewer temporaries).
        self.lane = rows.lane_of(dtype, width, length, self.channel.offsets,
                                 [owner.stacks[k].route.block_size for k in self.channel.stacks])
        self.unit = self.lane if comm.size < self.lane // 128 else 1
        self.sent = self.lane // self.unit   # a written piece's lanes, as sent

    @staticmethod
    def cost(owner: OwnerPlan, dtype: Any, reduced: bool) -> Cost:
        """The all-to-all of the holders' blocks back."""
        return Cost((owner.num_devices - 1) * owner.back[dtype].length * dtype.itemsize)

    def empty(self) -> Directions:
        return Directions(jnp.zeros((self.comm.size, self.channel.length), self.dtype),
                          {}, {}, None)

    def store(self, acc: Directions, k: int, j0: int, o: jax.Array,
              owned: jax.Array | None) -> Directions:
        sp, n = self.owner.stacks[k], o.shape[0]

        def split(i):  # (N, n, block): each holder's block, as member i's layout splits
            route, member = sp.routes[i], sp.stack.members[i]
            blocks = _matrix_to_grid(route, member.stored_to_matrix(o))
            blocks = rows.take_static(blocks, np.asarray(route.block_of), axis=1)
            return jnp.transpose(blocks, (1, 0, 2))

        blocks = _by_variant(sp, self.comm, j0, n, split, axis=1).reshape(self.comm.size, -1)
        start = self.comm.pick(self.channel.offsets[k]) + j0 * sp.route.block_size

        def whole():
            return rows.dynamic_update(acc.buffer, blocks, start, 1, owned)

        if self.comm.size == 1:
            return acc._replace(buffer=whole())
        # TPU: rows go into the unsent pieces they may fall in on some device; those complete after
        # this store (slots lie in the channel in order) are sent: the first len(acc.got).
        size, offsets = sp.route.block_size, np.asarray(self.channel.offsets[k])
        lo, hi = int(offsets.min()) + j0 * size, int(offsets.max()) + (j0 + n) * size
        unsent = range(len(acc.got), len(self.bounds))
        touched = [p for p in unsent if self.bounds[p][0] < hi and lo < self.bounds[p][1]]
        nxt = int((offsets + np.minimum(j0 + n, np.asarray(sp.counts)) * size).min())
        done = [p for p in unsent if self.bounds[p][1] <= nxt]
        parts = {p: acc.parts.get(p, self._zeros(p)) for p in touched + done}

        def tpu():
            new, unit, written = dict(parts), self.unit, rows.lanes(blocks, self.unit)
            # + a 0 made from O: else the TPU compiler makes every mask at the start (13 MiB).
            ready = start // unit + after(jnp.zeros((), jnp.float32), o).astype(np.int32)
            for p in touched:
                new[p] = self._into(parts[p], written, ready, self.bounds[p][0] // unit,
                                    lo // unit, (int(offsets.max()) + j0 * size) // unit, owned)
            got = [self.comm.exchange(rows.lanes(new[p], self.sent)) for p in done]
            last = got[-1] if got else new[touched[-1]] if touched else blocks
            return (acc.buffer, last[(slice(0, 1),) * last.ndim].reshape(1, 1),
                    *[new[p] for p in touched], *got)

        def default():
            return (whole(), acc.buffer[:1, :1], *[parts[p] for p in touched],
                    *[rows.lanes(parts[p], self.sent) for p in done])

        out = per_platform("exchange", tpu=tpu, default=default)
        written = {**acc.parts, **dict(zip(touched, out[2:2 + len(touched)]))}
        return Directions(out[0], {p: x for p, x in written.items() if p not in done},
                          {**acc.got, **dict(zip(done, out[2 + len(touched):]))}, out[1])

    def _zeros(self, p: int) -> jax.Array:
        c0, c1 = self.bounds[p]
        return rows.lanes(jnp.zeros((self.comm.size, c1 - c0), self.dtype), self.unit)

    @staticmethod
    def _into(part: jax.Array, blocks: jax.Array, start, c0: int, first: int, last: int,
              owned: jax.Array | None) -> jax.Array:
        """``part`` (columns ``c0 ..``) with what falls in it of ``blocks`` (columns ``start ..``,
        ``first <= start <= last``; lanes: in lanes) where ``owned``; padded, never clamped."""
        length, width, more = blocks.shape[1], part.shape[1], (1,) * (part.ndim - 2)
        if first == last and owned is None and first <= c0 <= first + length - width:
            return blocks[:, c0 - first:c0 - first + width]   # all of it from here: no mask
        a, b = max(0, c0 - last), min(length, c0 + width - first)
        padded = jnp.pad(blocks[:, a:b], ((0, 0), (width, width)) + ((0, 0),) * len(more))
        window = rows.dynamic_slice(padded, c0 - start - a + width, width, 1)
        cols = c0 + jax.lax.broadcasted_iota(np.int32, (1, width) + more, 1)
        mask = (cols >= start) & (cols < start + length)
        return jnp.where(mask if owned is None else mask & owned, window, part)

    def finish(self, acc: Directions, local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        if self.comm.size == 1:
            return self._whole(acc.buffer, local_shapes)

        def tpu():
            got = [acc.got[p] if p in acc.got
                   else self.comm.exchange(rows.lanes(acc.parts.get(p, self._zeros(p)), self.sent))
                   for p in range(len(self.bounds))]
            return self._from_pieces(got, local_shapes)

        return per_platform("exchange", tpu=tpu,
                            default=lambda: self._whole(acc.buffer, local_shapes))

    def _whole(self, buffer: jax.Array, local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        received, out = self.comm.exchange(buffer), {}
        for k in self.channel.stacks:
            sp = self.owner.stacks[k]
            got = rows.member_rows(received, self.channel, k, sp, sp.route.block_size)
            for m, route, r in zip(sp.stack.members, sp.routes, got):
                y = rows.shaped(r, (m.batch,) + route.block_shape, len(route.block_shape))
                out[m.index] = m.join_batch(y, local_shapes[m.index])
        return out

    def _from_pieces(self, got: list[jax.Array],
                     local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        """Every leaf's blocks from the received column pieces (TPU)."""
        out = {}
        for k in self.channel.stacks:
            sp = self.owner.stacks[k]
            size = sp.route.block_size
            for m, route, spans in zip(sp.stack.members, sp.routes,
                                       rows.member_spans(self.channel, k, sp, size)):
                y = jnp.stack([rows.span(got, self.bounds, d, at, size, self.lane)
                               for d, at in spans])
                y = rows.shaped(y, (m.batch,) + route.block_shape, len(route.block_shape))
                out[m.index] = m.join_batch(y, local_shapes[m.index])
        return out
