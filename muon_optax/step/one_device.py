"""The Muon phase on one device: stack -> kernel -> unstack.

Each stack (matrices of one stored shape, dtype and group options; see
:mod:`muon_optax.params.layout`) is read as one ``(K, R, C)`` array, runs the rule's kernel
(:func:`muon_optax.rule.muon.muon_step`) with its state, and is split back into its leaves,
which take the cautious update in their own layout. Nothing here knows about devices:
the sharded engine (:mod:`muon_optax.step.sharded`) adds ownership and transport around the
same kernel and the same per-leaf finish.

The state of a stack is a pair of buffers of its own in the stack's layout
(:class:`MuonBuffers`, ``(K, R, C)``), not one array per leaf: the kernel updates each
chunk's rows in place. Kept per leaf (optax's layout, mirroring the params), the
momentum is stacked into a copy each step: benchmarks/state_layout.py measured the
same kernel both ways on d256x4 (2 CPU cores) at a per-rep median of 1.017x the
Muon phase's time and 20.0 MiB of temporaries against 16.0 MiB. The buffers stay: the
same layout as the sharded state (one format to export, import and shard), and less
memory.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.params.layout import Stack
from muon_optax.plan.plan import StackPlan, TreePlan
from muon_optax.rule import polar
from muon_optax.rule.muon import MuonStackState
from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform
from muon_optax.step.guard import scaled
from muon_optax.step.matrices import (
    chunk_bytes,
    chunk_runs,
    chunks,
    finish_leaves,
    kernel_in_loop,
    matrix_hparams,
)
from muon_optax.step.state import MuonBuffers


def _pieces(st: Stack, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(member, first, last)``: the members' matrices among stack slots ``lo .. hi-1``
    (``first .. last-1`` of that member's batch)."""
    out, start = [], 0
    for i, m in enumerate(st.members):
        a, b = max(lo, start), min(hi, start + m.batch)
        if a < b:
            out.append((i, a - start, b - start))
        start += m.batch
    return out


def _chunk_step(sp: StackPlan, bufs: MuonBuffers, g: jax.Array, lo: int, hi: int, hps,
                count):
    """Slots ``lo .. hi-1`` of one stack: the kernel on their matrices of the stack's
    state buffers (in the stack's layout), written back in place once read."""
    st, whole = sp.stack, (lo, hi) == (0, sp.stack.size)
    state = MuonStackState(bufs.momentum, bufs.second_moment)
    if not whole:
        state = MuonStackState(bufs.momentum[lo:hi], bufs.second_moment[lo:hi])
    hp = matrix_hparams(st, hps, np.arange(lo, hi)[None], lambda t: np.asarray(t)[0])
    o, state, d = st.config.step(g, state, hp, count, st.dtype)
    # The second moment is written once O is computed: the old one is dead by then.
    new_second = after(state.second_moment, o)
    if whole:
        return o, MuonBuffers(state.momentum, new_second), d
    return o, MuonBuffers(
        jax.lax.dynamic_update_slice_in_dim(bufs.momentum, state.momentum, lo, axis=0),
        jax.lax.dynamic_update_slice_in_dim(bufs.second_moment, new_second, lo, axis=0)), d


def muon_phase(plan: TreePlan, configs: dict[str, Any], hps, count, g_leaves, p_leaves,
               state_muon: tuple[MuonBuffers, ...], scale: jax.Array | None,
               updates: list) -> tuple[MuonBuffers, ...]:
    """Every Muon leaf on one device: fills ``updates``; returns the new state buffers
    (one pair per stack). ``scale``: ``max_grad_norm``'s factor, or None.

    The form depends on the platform the step is compiled for. CPU and TPU run each stack
    in chunks of at most :func:`chunk_bytes`, the polar iteration a loop: the TPU
    compiler's temporaries then scale with one chunk (BENCHMARKS.md, "The TPU
    compiler"). On TPU the chunks of a stack also run in loops of up to
    :data:`LOOP_CHUNKS` chunks, one kernel per loop: the compiler's time grows with the
    kernels in the program (d768x12 one chip: 36 kernels compiled in 45 s, 9 loops in
    16 s, optax.contrib.muon 13 to 15 s). CPU keeps one kernel per chunk (its program is
    unchanged by the loops). GPUs run each stack as one batch, the iteration written out:
    on an H200 (d768x12) chunks took the step from 5.9 to 10.2 ms, and the loop added
    0.6 ms.
    """
    def form(budget: int, unrolled: bool, loop: int = 0):
        def run():
            out = list(updates)
            with polar.written_out(unrolled):
                bufs = _stacks_in_chunks(plan, configs, hps, count, g_leaves, p_leaves,
                                         state_muon, scale, out, budget, loop)
            return bufs, [out[m.index] for m in plan.muon]
        return run

    chunked, whole = form(chunk_bytes(plan), False), form(WHOLE, True)
    looped = form(chunk_bytes(plan), False, LOOP_CHUNKS * chunk_bytes(plan))
    bufs, muon_updates = per_platform("loop", cuda=whole, rocm=whole, tpu=looped,
                                      default=chunked)
    for m, u in zip(plan.muon, muon_updates):
        updates[m.index] = u
    return bufs


# A budget no stack reaches: every stack one chunk.
WHOLE = 1 << 62

# On TPU, up to this many chunks' worth of a stack (chunk_bytes each) run as one kernel in
# a loop (_run_in_loop); their gradients and directions are alive together. d768x12 one
# chip, temporaries 57, 70, 106 and 142 MiB with 2, 4, 8 and every chunk in a loop
# (optax.contrib.muon 53 MiB); compile time falls with fewer loops, within the noise of
# a shared machine past 4.
LOOP_CHUNKS = 4


def _stacks_in_chunks(plan: TreePlan, configs: dict[str, Any], hps, count, g_leaves,
                      p_leaves, state_muon: tuple[MuonBuffers, ...], scale: jax.Array | None,
                      updates: list, budget: int, loop_bytes: int = 0
                      ) -> tuple[MuonBuffers, ...]:
    """Each stack in chunks of at most ``budget`` bytes (its matrices batched), one after
    another, and a leaf takes its update as soon as its last matrix is through: each
    chunk's stacking copy waits for the previous chunk's updates, so one chunk's
    temporaries and directions are alive at a time.

    ``loop_bytes`` (0: off): runs of equal chunks whose matrices take at most that many
    bytes are one kernel in a loop (:func:`_run_in_loop`) instead of one kernel each, so
    that the compiled program holds a few kernels per stack, not one per chunk.
    """
    bufs = dict(zip(plan.state_keys, state_muon))
    prev = None
    for sp in plan.owner.stacks:
        st, pieces, duals = sp.stack, {}, {}
        matrix_bytes = 4 * st.rows * st.cols
        spans = chunks(st.size, matrix_bytes, budget)
        for run in chunk_runs(spans, matrix_bytes, loop_bytes):
            gs = [jnp.concatenate([st.members[i].to_stored(after(g_leaves[
                st.members[i].index], prev))[a:b] for i, a, b in _pieces(st, lo, hi)])
                for lo, hi in run]
            if len(run) == 1:
                o, bufs[sp.state_key], d = _chunk_step(sp, bufs[sp.state_key],
                                                       scaled(gs[0], scale), *run[0], hps, count)
                outs = [(o, d)]
            else:
                outs, bufs[sp.state_key] = _run_in_loop(sp, bufs[sp.state_key], gs, run,
                                                        scale, hps, count)
            for (lo, hi), (o, d) in zip(run, outs):
                done = _collect(st, _pieces(st, lo, hi), o, d, pieces, duals)
                for i in done:   # leaves whose matrices are all through
                    m = st.members[i]
                    o_leaf = m.from_stored(jnp.concatenate(pieces.pop(i)))
                    scales = ({m.index: sum(jnp.sum(x) for x in duals.pop(i))} if duals
                              else {})
                    finish_leaves(plan, configs, hps, {m.index: o_leaf}, scales, p_leaves,
                                  updates, only=(m,))
                prev = updates[st.members[done[-1]].index] if done else o
    return tuple(bufs.values())


def _collect(st: Stack, parts, o, d, pieces: dict, duals: dict) -> list[int]:
    """Files a chunk's directions (and ``<U, O>``) under their members; returns the
    members whose matrices are all through."""
    first, done = 0, []
    for i, a, b in parts:
        pieces.setdefault(i, []).append(o[first:first + b - a])
        if d is not None:
            duals.setdefault(i, []).append(d[first:first + b - a])
        first += b - a
        if b == st.members[i].batch:
            done.append(i)
    return done


def _run_in_loop(sp: StackPlan, bufs: MuonBuffers, gs: list, run: list[tuple[int, int]],
                 scale: jax.Array | None, hps, count):
    """Equal chunks ``run`` of one stack (gradients ``gs``) as one kernel in a loop
    (:func:`muon_optax.step.matrices.kernel_in_loop`), the state read from and written
    back into the stack's buffers in place. Returns each chunk's ``(O, <U, O> or None)``
    and the new buffers: the same arithmetic as :func:`_chunk_step` on each chunk."""
    st, per, lo0 = sp.stack, run[0][1] - run[0][0], run[0][0]
    n = len(run)
    hp_all = matrix_hparams(st, hps, np.arange(lo0, lo0 + n * per)[None],
                            lambda t: np.asarray(t)[0])

    def read(bufs, at):
        return MuonStackState(*(jax.lax.dynamic_slice_in_dim(b, lo0 + at, per, axis=0)
                                for b in bufs))

    def write(bufs, at, new, o):
        new = (new.momentum, after(new.second_moment, o))
        return MuonBuffers(*(jax.lax.dynamic_update_slice_in_dim(b, x, lo0 + at, axis=0)
                             for b, x in zip(bufs, new)))

    o_all, bufs, d_all = kernel_in_loop(st, jnp.concatenate(gs), per, hp_all, bufs, read,
                                        write, count, scale)
    outs = [(o_all[j * per:(j + 1) * per],
             None if d_all is None else d_all[j * per:(j + 1) * per]) for j in range(n)]
    return outs, bufs
