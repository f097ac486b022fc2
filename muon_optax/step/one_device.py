"""The Muon phase on one device: each stack, one ``(K, R, C)`` array, through the rule's
kernel and back into its leaves. The state is in the stack's layout, updated in place; kept
per leaf, the momentum would be stacked into a copy each step (benchmarks/state_layout.py)."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.plan.plan import StackPlan, TreePlan
from muon_optax.rule import polar
from muon_optax.rule.muon import MuonStackState
from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform
from muon_optax.step import matrices
from muon_optax.step.guard import scaled
from muon_optax.step.rows import member_runs
from muon_optax.step.state import MuonBuffers


def _chunk_step(sp: StackPlan, bufs: MuonBuffers, gs: list, run: list[tuple[int, int]],
                scale: jax.Array | None, hps, count):
    """:func:`_run_in_loop` for one chunk ``run[0] = (lo, hi)``, its state updated in place."""
    g, (lo, hi), st = scaled(gs[0], scale), run[0], sp.stack
    whole = (lo, hi) == (0, st.size)
    state = MuonStackState(*(b if whole else b[lo:hi] for b in bufs))
    hp = matrices.matrix_hparams(st, hps, np.arange(lo, hi)[None], lambda t: np.asarray(t)[0])
    o, state, d = st.config.step(g, state, hp, count, st.dtype)
    # The second moment is written once O is computed: the old one is dead by then.
    new = (state.momentum, after(state.second_moment, o))
    if whole:
        return [(o, d)], MuonBuffers(*new)
    return [(o, d)], MuonBuffers(*(jax.lax.dynamic_update_slice_in_dim(b, x, lo, axis=0)
                                   for b, x in zip(bufs, new)))


def muon_phase(plan: TreePlan, configs: dict[str, Any], hps, count, g_leaves, p_leaves,
               state_muon: tuple[MuonBuffers, ...], scale: jax.Array | None,
               updates: list) -> tuple[MuonBuffers, ...]:
    """Every Muon leaf into ``updates`` (gradients times ``scale``, if not None); returns the
    new state. CPU and TPU run chunks of :func:`chunk_bytes`, the polar iteration a loop: the
    TPU compiler's temporaries scale with one chunk (BENCHMARKS.md, "The TPU compiler"), and on
    TPU up to :data:`LOOP_CHUNKS` chunks are one kernel in a loop (compiles faster). GPUs run
    each stack whole, the iteration written out: faster there."""
    def form(budget: int, unrolled: bool, loop: int = 0):
        out = list(updates)
        with polar.written_out(unrolled):
            bufs = _stacks_in_chunks(plan, configs, hps, count, g_leaves, p_leaves,
                                     state_muon, scale, out, budget, loop)
        return bufs, [out[m.index] for m in plan.muon]

    chunk, whole = matrices.chunk_bytes(plan), partial(form, WHOLE, True)
    bufs, muon_updates = per_platform("loop", cuda=whole, rocm=whole,
                                      tpu=partial(form, chunk, False, LOOP_CHUNKS * chunk),
                                      default=partial(form, chunk, False))
    for m, u in zip(plan.muon, muon_updates):
        updates[m.index] = u
    return bufs


# A budget no stack reaches: every stack one chunk.
WHOLE = 1 << 62

# On TPU, up to this many chunks of a stack run as one kernel in a loop (_run_in_loop):
# their gradients and directions are alive together, and past 4 compile no faster.
LOOP_CHUNKS = 4


def _stacks_in_chunks(plan: TreePlan, configs: dict[str, Any], hps, count, g_leaves,
                      p_leaves, state_muon: tuple[MuonBuffers, ...], scale: jax.Array | None,
                      updates: list, budget: int, loop_bytes: int = 0
                      ) -> tuple[MuonBuffers, ...]:
    """Each stack in chunks of at most ``budget`` bytes (runs within ``loop_bytes`` a loop),
    each copy after the previous chunk's updates: one chunk's temporaries at a time."""
    bufs, prev = dict(zip(plan.state_keys, state_muon)), None
    for sp in plan.owner.stacks:
        st, pieces, duals = sp.stack, {}, {}
        matrix_bytes = 4 * st.rows * st.cols
        spans = matrices.chunks(st.size, matrix_bytes, budget)
        for run in matrices.chunk_runs(spans, matrix_bytes, loop_bytes):
            gs = [jnp.concatenate([
                st.members[i].to_stored(after(g_leaves[st.members[i].index], prev))[a:b]
                for i, a, b in member_runs(st, np.arange(lo, hi))]) for lo, hi in run]
            step = _chunk_step if len(run) == 1 else _run_in_loop
            outs, bufs[sp.state_key] = step(sp, bufs[sp.state_key], gs, run, scale, hps, count)
            for (lo, hi), (o, d) in zip(run, outs):
                parts, first = member_runs(st, np.arange(lo, hi)), 0
                for i, a, b in parts:   # the chunk's directions (and <U, O>) per member
                    pieces.setdefault(i, []).append(o[first:first + b - a])
                    if d is not None:
                        duals.setdefault(i, []).append(d[first:first + b - a])
                    first += b - a
                done = [i for i, a, b in parts if b == st.members[i].batch]
                for i in done:   # leaves whose matrices are all through
                    m = st.members[i]
                    o_leaf = m.from_stored(jnp.concatenate(pieces.pop(i)))
                    scales = {m.index: sum(jnp.sum(x) for x in duals.pop(i))} if duals else {}
                    matrices.finish_leaves(plan, configs, hps, {m.index: o_leaf}, scales,
                                           p_leaves, updates, only=(m,))
                prev = updates[st.members[done[-1]].index] if done else o
    return tuple(bufs.values())


def _run_in_loop(sp: StackPlan, bufs: MuonBuffers, gs: list, run: list[tuple[int, int]],
                 scale: jax.Array | None, hps, count):
    """Equal chunks ``run`` (gradients ``gs``) as one loop of :func:`_chunk_step`'s arithmetic."""
    st, per, lo0, n = sp.stack, run[0][1] - run[0][0], run[0][0], len(run)
    hp_all = matrices.matrix_hparams(st, hps, np.arange(lo0, lo0 + n * per)[None],
                                     lambda t: np.asarray(t)[0])

    def read(bufs, at):
        return MuonStackState(*(jax.lax.dynamic_slice_in_dim(b, lo0 + at, per, axis=0)
                                for b in bufs))

    def write(bufs, at, new, o):
        new = (new.momentum, after(new.second_moment, o))
        return MuonBuffers(*(jax.lax.dynamic_update_slice_in_dim(b, x, lo0 + at, axis=0)
                             for b, x in zip(bufs, new)))

    o_all, bufs, d_all = matrices.kernel_in_loop(st, jnp.concatenate(gs), per, hp_all, bufs,
                                                 read, write, count, scale)
    outs = [(o_all[j * per:(j + 1) * per],
             None if d_all is None else d_all[j * per:(j + 1) * per]) for j in range(n)]
    return outs, bufs
