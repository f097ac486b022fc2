"""The transports of :mod:`muon_optax.plan.routes`: a stack's owned matrices come from a
*source*, its directions go to a *sink* (values in, values out). Gather: reduce-scatter and
all-gather; exchange (:mod:`~muon_optax.step.exchange`): all-to-alls; local: in place."""

from __future__ import annotations

import math
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.plan.plan import OwnerPlan
from muon_optax.plan.routes import EXCHANGE, GATHER, LOCAL
from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform
from muon_optax.step import rows
from muon_optax.step.collectives import ALL_GATHER_MAX_DEVICES, Collectives, Cost
from muon_optax.step.exchange import ExchangeSink, ExchangeSource
from muon_optax.step.guard import scaled

PIECE_MATRICES, PIECE_ELEMENTS = 8, 1 << 23   # PIECE_ELEMENTS: 32 MiB of float32


def scatter_piece(owner: OwnerPlan) -> int:
    """Elements of a device's row in one TPU piece of the gradients' reduce-scatter and the
    directions' all-gather: half a largest Muon matrix (ZeRO-2 d1280x20, 8 chips: a whole one
    1,440.6 MiB of temporaries, half 696.3); in all ``PIECE_MATRICES`` of them at most (64 chips'
    rows are about one each), ``PIECE_ELEMENTS`` at least (each piece a collective to compile)."""
    n = owner.num_devices
    largest = max([1] + [sp.stack.rows * sp.stack.cols for sp in owner.stacks])
    return max(1, min(largest // 2, largest * PIECE_MATRICES // n), PIECE_ELEMENTS // n)


class GatherSource:
    """Owned matrices of the ``"gather"`` stacks of one dtype: under ZeRO-2 reduce-scattered
    (mean) from a flat buffer; with ``mesh=``'s reduced gradients, from the whole leaves."""

    def __init__(self, owner: OwnerPlan, dtype: Any, leaves: list[jax.Array], comm: Collectives):
        self.owner, self.comm, self.leaves = owner, comm, leaves
        self.channel = owner.gather[dtype]
        self.buffer = None if comm.grads_reduced else self._reduce_scatter(dtype)

    @staticmethod
    def cost(owner: OwnerPlan, dtype: Any, reduced: bool) -> Cost:
        """The reduce-scatter of the flat buffer (a share: the channel), unless ``reduced``."""
        n = 0 if reduced else owner.num_devices - 1
        return Cost(n * owner.gather[dtype].length * dtype.itemsize)

    def _reduce_scatter(self, dtype: Any) -> jax.Array:
        parts: list[list[jax.Array]] = [[] for _ in range(self.comm.size)]
        for k in self.channel.stacks:
            sp = self.owner.stacks[k]
            rows.owned_parts(sp, [m.to_stored(self.leaves[m.index]) for m in sp.stack.members],
                             parts, rows.flat)
        return self.comm.mean_scatter_rows(parts, self.channel.length, scatter_piece(self.owner),
                                           dtype)

    def load(self, held: dict, k: int, j0: int, n: int, prev: jax.Array | None):
        sp = self.owner.stacks[k]
        st = sp.stack
        if self.buffer is not None:
            size = st.rows * st.cols
            start = self.comm.pick(self.channel.offsets[k])
            x = rows.dynamic_slice(self.buffer, start + j0 * size, n * size, 0)
            return rows.shaped(x, (n, st.rows, st.cols)), held
        mine = self.comm.pick(np.maximum(sp.slots, 0)[:, j0:j0 + n])  # unowned: matrix 0
        if isinstance(mine, np.ndarray):   # one device: stack only these slots, not all
            return jnp.concatenate([st.members[i].to_stored(after(
                self.leaves[st.members[i].index], prev))[lo:hi]
                for i, lo, hi in rows.member_runs(st, mine.reshape(-1))]), held
        # One stack's stacking copy at a time: it waits for the previous stack.
        if k not in held:
            held = {k: st.stack([after(self.leaves[m.index], prev) for m in st.members])}
        return jnp.take(held[k], mine, axis=0), held


class GatherSink:
    """Directions of the ``"gather"`` stacks: this device's share, all-gathered (on a
    one-device axis too: it marks the result replicated)."""

    def __init__(self, owner: OwnerPlan, dtype: Any, comm: Collectives):
        self.owner, self.comm = owner, comm
        self.channel, self.dtype = owner.gather[dtype], dtype
        self.sizes = [owner.stacks[k].stack.rows * owner.stacks[k].stack.cols
                      for k in self.channel.stacks]

    @staticmethod
    def cost(owner: OwnerPlan, dtype: Any, reduced: bool) -> Cost:
        """The all-gather of this device's share of directions."""
        return Cost((owner.num_devices - 1) * owner.gather[dtype].length * dtype.itemsize)

    def empty(self) -> jax.Array:
        return jnp.zeros(self.channel.length, self.dtype)   # this device's share

    def store(self, acc: jax.Array, k: int, j0: int, o: jax.Array,
              owned: jax.Array | None) -> jax.Array:
        st = self.owner.stacks[k].stack
        start = self.comm.pick(self.channel.offsets[k]) + j0 * st.rows * st.cols
        return rows.dynamic_update(acc, rows.flat(o), start, 0, owned)

    def finish(self, acc: jax.Array, local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        del local_shapes   # every device gets the whole leaves
        if not self.comm.active:
            return self._whole(acc)
        return per_platform("gather", acc, default=self._whole, tpu=self._on_tpu)

    def _on_tpu(self, buffer: jax.Array) -> dict[int, jax.Array]:   # groups, or column pieces
        if self.comm.size > ALL_GATHER_MAX_DEVICES:
            group = PIECE_ELEMENTS // max(1, self.channel.length)   # as pieces: that at least
            return self._by_groups(buffer, max(PIECE_MATRICES, group))
        return self._by_pieces(buffer, scatter_piece(self.owner))

    @staticmethod
    def _leaf(st, m, x: jax.Array) -> jax.Array:   # member m's rows of x as its leaf
        return m.from_stored(rows.shaped(x, (m.batch, st.rows, st.cols)))

    def _completed_by(self, piece_of) -> dict[int, list]:
        """Piece -> the members it completes (their matrices' last ``piece_of(d, at, size)``)."""
        ready: dict[int, list] = {}
        for k, size in zip(self.channel.stacks, self.sizes):
            sp = self.owner.stacks[k]
            for m, spans in zip(sp.stack.members, rows.member_spans(self.channel, k, sp, size)):
                last = max(piece_of(d, at, size) for d, at in spans)
                ready.setdefault(last, []).append((sp.stack, m, spans, size))
        return ready

    def _whole(self, buffer: jax.Array) -> dict[int, jax.Array]:
        everything = self.comm.gather(buffer, 0).reshape(self.comm.size, -1)
        out = {}
        for k, size in zip(self.channel.stacks, self.sizes):
            sp = self.owner.stacks[k]
            got = rows.member_rows(everything, self.channel, k, sp, size)
            out.update({m.index: self._leaf(sp.stack, m, x) for m, x in zip(sp.stack.members, got)})
        return out

    def _by_pieces(self, buffer: jax.Array, piece: int) -> dict[int, jax.Array]:
        """The share gathered in ``(N, piece)`` column pieces one after another (on TPU rows cut
        from a gathered 1-D buffer are a copy), in lanes where whole tiles: slices, not copies."""
        length, piece = self.channel.length, max(1, piece)
        bounds = [(c0, min(length, c0 + piece)) for c0 in range(0, length, piece)]
        lane = rows.lane_of(self.dtype, piece, length, self.channel.offsets, self.sizes)
        ready = self._completed_by(lambda d, at, size: (at + size - 1) // piece)
        got, prev, out = [], None, {}
        for p, (c0, c1) in enumerate(bounds):
            part = after(rows.lanes(jax.lax.slice_in_dim(buffer, c0, c1), lane), prev)
            got.append(self.comm.gather(part[None], 0))
            prev = got[-1]
            for st, m, spans, size in ready.get(p, []):
                x = jnp.stack([rows.span(got, bounds, d, at, size, lane) for d, at in spans])
                out[m.index] = self._leaf(st, m, x)
        return out

    def _by_groups(self, buffer: jax.Array, group: int) -> dict[int, jax.Array]:
        """``group`` devices' shares at a time, summed with the others' zeros (the TPU compiler's
        all-gather on 64 chips): each completes its devices' matrices, a column piece none
        before the last (ZeRO-2 d1280x20 on 64 v5p chips held 8 pieces of 200 MiB at once)."""
        n, me = self.comm.size, self.comm.index()
        lane = rows.lane_of(self.dtype, self.channel.length, self.channel.offsets, self.sizes)
        ready = self._completed_by(lambda d, at, size: d // group)
        mine, got, out = rows.lanes(buffer, lane), [], {}
        for g, d0 in enumerate(range(0, n, group)):
            here = min(group, n - d0)   # its row written in (a masked select compiled slowly)
            row = jnp.where((me >= d0) & (me < d0 + here), me - d0, here)   # past them: cut
            zeros = after(jnp.zeros((here + 1,) + mine.shape, mine.dtype), got[-1] if got else None)
            part = jax.lax.dynamic_update_index_in_dim(zeros, mine, row, 0)[:here]
            got.append(self.comm.sum(part))
            for st, m, spans, size in ready.get(g, []):
                x = jnp.stack([got[d // group][d % group, at // lane:(at + size) // lane]
                               for d, at in spans])
                out[m.index] = self._leaf(st, m, x)
        return out


class LocalSource:
    """The ``"local"`` stacks: each device's own matrices (its block of each leaf), by chunk."""

    def __init__(self, owner: OwnerPlan, leaves: list[jax.Array]):
        self.owner, self.leaves = owner, leaves

    def load(self, held: dict, k: int, j0: int, n: int, prev: jax.Array | None):
        st, parts, start = self.owner.stacks[k].stack, [], 0
        for m in st.members:   # only the members in slots j0 .. j0+n are traced
            count = math.prod(self.leaves[m.index].shape[a] for a in m.batch_axes)  # in this block
            if max(j0, start) < min(j0 + n, start + count):
                x = m.to_stored(after(self.leaves[m.index], prev))
                parts.append(x[max(j0 - start, 0):j0 + n - start])
            start += count
        return jnp.concatenate(parts), held


class LocalSink:
    def __init__(self, owner: OwnerPlan):
        self.owner = owner

    def empty(self) -> dict[int, tuple]:
        return {}   # stack -> its directions, in store order

    def store(self, acc: dict, k: int, j0: int, o: jax.Array, owned: jax.Array | None):
        del j0, owned   # every device owns every slot of a local stack
        return {**acc, k: acc.get(k, ()) + (o,)}

    def finish(self, acc: dict, local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        out = {}
        for k, parts in acc.items():
            full, start = jnp.concatenate(parts), 0
            for m in self.owner.stacks[k].stack.members:
                count = math.prod(local_shapes[m.index][a] for a in m.batch_axes)  # in this block
                out[m.index] = m.from_stored(full[start:start + count], local_shapes[m.index])
                start += count
        return out


class Transports:
    """Every stack's source and sink, by transport and dtype. The Muon loop threads a ``carry``
    (:meth:`empty`): per key the source's ``held`` and the sink's ``acc`` (directions so far)."""

    def __init__(self, owner: OwnerPlan, leaves: list[jax.Array], comm: Collectives):
        self.owner, self.comm = owner, comm
        self.sources: dict[Any, Any] = {}
        self.sinks: dict[Any, Any] = {}
        for dt in owner.gather:
            self.sources[GATHER, dt] = GatherSource(owner, dt, leaves, comm)
            self.sinks[GATHER, dt] = GatherSink(owner, dt, comm)
        for dt in owner.exchange:
            self.sources[EXCHANGE, dt] = ExchangeSource(owner, dt, leaves, comm)
            self.sinks[EXCHANGE, dt] = ExchangeSink(owner, dt, comm)
        self.sources[LOCAL] = LocalSource(owner, leaves)
        self.sinks[LOCAL] = LocalSink(owner)

    @staticmethod
    def cost(owner: OwnerPlan, reduced: bool) -> Cost:
        """The sum of what each source and sink sends (local: nothing)."""
        return sum((cls.cost(owner, dt, reduced)
                    for dts, classes in ((owner.gather, (GatherSource, GatherSink)),
                                         (owner.exchange, (ExchangeSource, ExchangeSink)))
                    for dt in dts for cls in classes), Cost())

    def _key(self, k: int):
        sp = self.owner.stacks[k]
        return LOCAL if sp.transport == LOCAL else (sp.transport, sp.stack.dtype)

    def empty(self) -> dict:
        return {key: ({}, sink.empty()) for key, sink in self.sinks.items()}

    def load(self, carry: dict, k: int, j0: int, n: int, prev: jax.Array | None,
             scale: jax.Array | None) -> tuple[jax.Array, dict]:
        """Slots ``j0 .. j0+n`` of stack ``k`` times ``scale`` (or None), and the new ``carry``. A
        copy of the leaves waits for ``prev`` (the last direction): one stack's copy at a time."""
        key = self._key(k)
        held, acc = carry[key]
        if key[0] == EXCHANGE and acc.stored is not None:
            # On TPU: no direction waits for the end of the Muon loop to be stored.
            prev = acc.stored
        x, held = self.sources[key].load(held, k, j0, n, prev)
        return scaled(x, scale), {**carry, key: (held, acc)}

    def reduced_buffers(self) -> list[jax.Array]:
        """ZeRO-2's reduce-scattered gradient shares (gather stacks only: every Muon element)."""
        return [src.buffer for src in self.sources.values()
                if isinstance(src, GatherSource) and src.buffer is not None]

    def store(self, carry: dict, k: int, j0: int, o: jax.Array,
              owned: jax.Array | None = None) -> dict:
        """``carry`` with directions ``o`` of slots ``j0 ..`` of stack ``k``, where ``owned``."""
        key = self._key(k)
        held, acc = carry[key]
        return {**carry, key: (held, self.sinks[key].store(acc, k, j0, o, owned))}

    def finish(self, carry: dict, local_shapes: dict[int, tuple]) -> dict[int, jax.Array]:
        """Every Muon leaf's direction, in this device's block (``local_shapes``)."""
        return {i: x for key, sink in self.sinks.items()
                for i, x in sink.finish(carry[key][1], local_shapes).items()}
