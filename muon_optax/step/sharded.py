"""The sharded Muon phase: per stack in turn (one stack's temporaries alive at a time), a
device loads its owned gradients through the transports, runs the kernel (state updated in
place) and stores the directions. Slots all devices own run batched, the rest one by one."""

from __future__ import annotations

from functools import partial
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.plan.plan import StackPlan, TreePlan
from muon_optax.plan.routes import EXCHANGE, LOCAL
from muon_optax.rule.muon import MuonStackState
from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform
from muon_optax.step import matrices
from muon_optax.step.collectives import Collectives, Cost, varying_axes
from muon_optax.step.one_device import LOOP_CHUNKS
from muon_optax.step.rows import dynamic_slice
from muon_optax.step.state import MuonBuffers
from muon_optax.step.transport import Transports


def _state_at(k: int, sp: StackPlan, plan: TreePlan, comm: Collectives, j: int):
    """Where slot ``j`` of stack ``k`` starts in this device's momentum and second-moment shares."""
    key = sp.state_key
    return (comm.pick(plan.owner.momentum[key].offsets[k]) + j * sp.stack.rows * sp.stack.cols,
            comm.pick(plan.owner.second[key].offsets[k]) + j * sp.second_size)


def _read_state(bufs: MuonBuffers, at, n: int, sp: StackPlan) -> MuonStackState:
    st = sp.stack
    momentum = dynamic_slice(bufs.momentum, at[0], n * st.rows * st.cols, 0)
    second = dynamic_slice(bufs.second_moment, at[1], n * sp.second_size, 0)
    return MuonStackState(momentum.reshape(n, st.rows, st.cols),
                          second.reshape((n,) + sp.second_shape))


def _write(buf: jax.Array, start, x: jax.Array, ready: jax.Array | None = None) -> jax.Array:
    """``x`` into ``buf`` in place once ``ready`` is computed: every read of the old values
    (XLA may repeat one in several fusions) feeds ``ready`` or ``x``: no copy of ``buf``."""
    x = after(x, ready).reshape(-1).astype(buf.dtype)
    return jax.lax.dynamic_update_slice_in_dim(buf, x, start, axis=0)


def _kept_where_unowned(owned, new: MuonStackState, old: MuonStackState) -> MuonStackState:
    """A masked slot's state: ``new`` where this device owns it, else ``old`` (as skipped)."""
    return new if owned is None else jax.tree.map(lambda a, b: jnp.where(owned, a, b), new, old)


def _owned_slot(g, state: MuonStackState, hp: dict, cfg: Any, count, dtype, order: bool,
                owned=None):
    """The kernel on a slot a device may not own (``owned``: the old state kept where false)."""
    o, new, d = cfg.step(g, state, hp, count, dtype, order=order)
    d = jnp.zeros((g.shape[0], 1, 1)) if d is None else d
    return o, _kept_where_unowned(owned, new, state), d


def _skipped(g, state: MuonStackState, dtype, leaf_scaled: bool):
    """An unowned slot: a zero direction (and ``<U, O>``), varying as computed ones are."""
    axes = tuple(sorted(varying_axes(g) | varying_axes(state.momentum)))

    def varying(x):
        return jax.lax.pcast(x, axes, to="varying") if axes else x

    d = jnp.zeros((g.shape[0], 1, 1))
    return varying(jnp.zeros(g.shape, dtype)), state, varying(d) if leaf_scaled else d


def _owned(sp: StackPlan, comm: Collectives, j):
    """Whether this device owns slot ``j`` (a traced bool); None where every device does."""
    if isinstance(j, int) and j < sp.base:
        return None
    return j < comm.pick(sp.counts)


def _base_loop(k, sp: StackPlan, plan, moves, scale, carry, bufs: MuonBuffers, hps, comm,
               count, prev, run: list[tuple[int, int]]):
    """Equal chunks ``run`` as one kernel in a loop (:func:`kernel_in_loop`); an exchange
    stack's only within 1.5 budgets (:func:`_runs`)."""
    st, lo, per = sp.stack, run[0][0], run[0][1] - run[0][0]
    n = len(run) * per
    extra = lo + n > sp.base     # a slot some devices do not own: masked there (_runs)
    assert per == 1 or not extra
    # A slot not owned is read alone: a read past a device's share is clamped (the window moves).
    parts = run if extra else [(lo, lo + n)]
    gs = []
    for a, b in parts:
        g, carry = moves.load(carry, k, a, b - a, prev, scale)
        gs.append(g)
    at = _state_at(k, sp, plan, comm, lo)

    def start(j):
        return at[0] + j * st.rows * st.cols, at[1] + j * sp.second_size

    def read(bufs, j):
        return _read_state(bufs, start(j), per, sp)

    def write(bufs, j, new, o):
        if extra:   # where not owned, the state as it was (as _skipped keeps it)
            new = _kept_where_unowned(_owned(sp, comm, lo + j), new, read(bufs, j))
        m, s = start(j)
        return MuonBuffers(_write(bufs.momentum, m, new.momentum),
                           _write(bufs.second_moment, s, new.second_moment, o))

    g_all = jnp.concatenate(gs) if len(gs) > 1 else gs[0]
    hp_all = matrices.matrix_hparams(st, hps, sp.slots[:, lo:lo + n], comm.pick)
    o_all, bufs, d_all = matrices.kernel_in_loop(st, g_all, per, hp_all, bufs, read, write, count)
    # Never read: an unowned slot's direction (its store keeps what is there) and <U, O>.
    for a, b in parts:
        carry = moves.store(carry, k, a, o_all[a - lo:b - lo], _owned(sp, comm, a))
    return carry, bufs, o_all, d_all


def _runs(sp: StackPlan, plan: TreePlan, loop_bytes: int) -> list[list[tuple[int, int]]]:
    """Stack ``sp``'s ``base`` slots in chunks of at most :func:`chunk_bytes`, in runs of equal
    ones within ``loop_bytes`` (0: off), a run of several one loop. With loops, chunks as equal
    as their count allows (or a divisor to 1.5x larger); a lone last matrix joins the first slot
    some devices do not own, masked there. Over 1.5 budgets: :func:`_unlooped_runs`."""
    matrix_bytes = 4 * sp.stack.rows * sp.stack.cols
    budget = matrices.chunk_bytes(plan)
    spans = matrices.chunks(sp.base, matrix_bytes, budget)
    if (loop_bytes and spans and sp.transport in (EXCHANGE, LOCAL)
            and 2 * sp.base * matrix_bytes > 3 * budget):
        return _unlooped_runs(sp.base, spans[0][1] - spans[0][0])
    if loop_bytes and spans:   # 6 slots in chunks of 3 and 3, not 4 and 2: one kernel
        per, cap = -(-sp.base // len(spans)), spans[0][1] - spans[0][0]
        if sp.base % per:   # 10 in chunks of 5 and 5, not 4, 4 and 2: one kernel
            per = min([d for d in range(cap, cap + cap // 2 + 1) if sp.base % d == 0], default=per)
        spans = [(lo, min(lo + per, sp.base)) for lo in range(0, sp.base, per)]
    runs = matrices.chunk_runs(spans, matrix_bytes, loop_bytes)
    if loop_bytes and sp.num_slots > sp.base and runs and runs[-1] == [(sp.base - 1, sp.base)]:
        runs[-1] = runs[-1] + [(sp.base, sp.base + 1)]
    return runs


def _unlooped_runs(base: int, cap: int) -> list[list[tuple[int, int]]]:
    """An exchange or local stack's slots on TPU: equal chunks (``base``'s largest divisor to
    ``cap``: one kernel), each a run of its own: a loop holds its run in and out (BENCHMARKS.md)."""
    per = max(d for d in range(1, min(cap, base) + 1) if base % d == 0)
    return [[(lo, lo + per)] for lo in range(0, base, per)]


def _stack_step(k: int, sp: StackPlan, plan: TreePlan, moves: Transports, scale, carry,
                bufs: MuonBuffers, hps, comm: Collectives, count, prev, loop_bytes: int):
    """One stack's owned slots: the first ``base`` in :func:`_runs`' chunks, the rest one by one,
    under ``lax.cond`` where not owned (on TPU run everywhere, masked: a ``cond`` holds its
    operands and results at once). Returns the carry, state buffers, last direction, ``<U, O>``."""
    cfg, dtype, duals = sp.stack.config, sp.stack.dtype, []
    runs = _runs(sp, plan, loop_bytes)
    for run in runs:
        if len(run) > 1:
            carry, bufs, prev, d = _base_loop(k, sp, plan, moves, scale, carry, bufs, hps,
                                              comm, count, prev, run)
        else:   # one batched program; the new momentum written as soon as U is formed
            ((lo, hi),) = run
            hp = matrices.matrix_hparams(sp.stack, hps, sp.slots[:, lo:hi], comm.pick)
            at = _state_at(k, sp, plan, comm, lo)
            g, carry = moves.load(carry, k, lo, hi - lo, prev, scale)
            prev, state, d = cfg.step(g, _read_state(bufs, at, hi - lo, sp), hp, count, dtype)
            bufs = MuonBuffers(_write(bufs.momentum, at[0], state.momentum),
                               _write(bufs.second_moment, at[1], state.second_moment, prev))
            carry = moves.store(carry, k, lo, prev)
        duals.append(d)
    for j in range(max([sp.base] + [run[-1][1] for run in runs]), sp.num_slots):
        owned = _owned(sp, comm, j)
        at = _state_at(k, sp, plan, comm, j)
        (g, carry), state = moves.load(carry, k, j, 1, prev, scale), _read_state(bufs, at, 1, sp)
        hp = matrices.matrix_hparams(sp.stack, hps, sp.slots[:, j:j + 1], comm.pick)
        o, state, d = per_platform(   # the state unchanged where not owned, either way
            "remainder", g, state, default=lambda g, s: jax.lax.cond(
                owned, lambda g, s: _owned_slot(g, s, hp, cfg, count, dtype, not loop_bytes),
                lambda g, s: _skipped(g, s, dtype, cfg.leaf_scaled), g, s),
            tpu=lambda g, s: _owned_slot(g, s, hp, cfg, count, dtype, False, owned))
        bufs = MuonBuffers(*(_write(b, start, x, o) for b, start, x in zip(bufs, at, state)))
        carry = moves.store(carry, k, j, o, owned)
        duals.append(d)
        prev = o
    return carry, bufs, prev, (jnp.concatenate([d.reshape(-1) for d in duals])
                               if cfg.leaf_scaled else None)


def _leaf_duals(plan: TreePlan, comm: Collectives, duals: dict[int, jax.Array]) -> dict:
    """``adaptive``'s ``<U, O>`` summed over each leaf's matrices, whichever devices own
    them: every device's slot values all-gathered (a few numbers each)."""
    if not duals:
        return {}
    keys = sorted(duals)   # the order they were stepped in
    offsets = np.cumsum([0] + [plan.owner.stacks[k].num_slots for k in keys]).tolist()
    everyone = comm.gather(jnp.concatenate([duals[k] for k in keys]), 0)
    out = {}
    for k, offset in zip(keys, offsets):
        sp = plan.owner.stacks[k]
        idx = sp.owners * offsets[-1] + offset + sp.slot_of()   # each matrix's in everyone
        starts = np.cumsum([0] + [m.batch for m in sp.stack.members])
        for m, first in zip(sp.stack.members, starts):
            out[m.index] = jnp.sum(everyone[idx[first:first + m.batch]])
    return out


def muon_cost(plan: TreePlan) -> Cost:
    """The kernel on every slot of a device's program (:meth:`OwnerPlan.program_flops`) and,
    with ``adaptive``, the all-gather of each device's float32 ``<U, O>`` per slot."""
    slots = sum(sp.num_slots for sp in plan.owner.stacks if sp.stack.config.leaf_scaled)
    return Cost((plan.num_devices - 1) * 4 * slots, plan.owner.program_flops())


def muon_phase(plan: TreePlan, configs: dict[str, Any], comm: Collectives, hps, count,
               moves: Transports, scale, g_leaves, p_leaves, state,
               updates: list) -> tuple[MuonBuffers, ...]:
    """Muon leaves into ``updates`` (gradients through ``moves``, times ``scale`` if not None);
    returns the new state buffers. On TPU runs of equal chunks are loops, else one kernel each."""
    def form(loop_bytes: int):
        bufs = dict(zip(plan.state_keys, state.muon))   # each (L,): updated in place
        prev, duals, carry, out = None, {}, moves.empty(), list(updates)
        for k, sp in enumerate(plan.owner.stacks):
            carry, bufs[sp.state_key], prev, d = _stack_step(
                k, sp, plan, moves, scale, carry, bufs[sp.state_key], hps, comm, count, prev,
                loop_bytes)
            if d is not None:
                duals[k] = d
        local_shapes = {m.index: tuple(g_leaves[m.index].shape) for m in plan.muon}
        matrices.finish_leaves(plan, configs, hps, moves.finish(carry, local_shapes),
                               _leaf_duals(plan, comm, duals), p_leaves, out)
        return tuple(bufs.values()), [out[m.index] for m in plan.muon]

    loop_bytes = LOOP_CHUNKS * matrices.chunk_bytes(plan)
    if all(_runs(sp, plan, loop_bytes) == _runs(sp, plan, 0) for sp in plan.owner.stacks):
        bufs, muon_updates = form(0)   # no loop to make: one program everywhere
    else:
        bufs, muon_updates = per_platform("loop", tpu=partial(form, loop_bytes),
                                          default=partial(form, 0))
    for m, u in zip(plan.muon, muon_updates):
        updates[m.index] = u
    return bufs
