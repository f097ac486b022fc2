"""The Muon phase on one device: stack -> kernel -> unstack.

Each stack (matrices of one stored shape, dtype and group options; see
:mod:`muon_optax.layout`) is read as one ``(K, R, C)`` array, runs the rule's kernel
(:func:`muon_optax.muon.muon_step`) with its state, and is split back into its leaves,
which take the cautious update in their own layout. Nothing here knows about devices:
the sharded engine (:mod:`muon_optax.stacks`) adds ownership and transport around the
same kernel and the same per-leaf finish.

The state of a stack is a pair of flat buffers of its own (:class:`MuonBuffers`, one
row), not one array per leaf: the kernel updates the momentum in the buffer's layout,
so XLA rewrites it in place. Kept per leaf (optax's layout, mirroring the params), the
momentum is stacked into a copy each step: benchmarks/state_layout.py measured the
same kernel both ways on d256x4 (2 CPU cores) at a per-rep median of 1.017x the
Muon phase's time and 20.0 MiB of temporaries against 16.0 MiB. The buffers stay: the
same layout as the sharded state (one format to export, import and shard), and less
memory.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from muon_optax.guard import scaled
from muon_optax.layout import Stack
from muon_optax.muon import MuonStackState, leaf_update, muon_step
from muon_optax.order import after
from muon_optax.plan import StackPlan, TreePlan


class MuonBuffers(NamedTuple):
    """The Muon state of the stacks of one state key, as ``(N, L)`` arrays split over
    the owner axes: row ``d`` is device ``d``'s share, the momenta (resp. NorMuon second
    moments) of the matrices it owns, back to back, stack by stack. On one device, one
    stack's: its matrices' momenta in stack order."""

    momentum: jax.Array
    second_moment: jax.Array


def matrix_hparams(stack: Stack, hps: dict, slots: np.ndarray,
                   pick: Callable[[np.ndarray], Any]) -> dict[str, Any]:
    """``momentum``, ``beta2`` and ``transposed`` of the matrices ``slots`` (stack
    indices, ``(devices, n)``; ``-1``: unowned, read as matrix 0) as :func:`muon_step`
    takes them: scalars when uniform, else per matrix. ``pick`` takes a device's row of a
    ``(devices, n)`` table (the identity's row 0 on one device)."""
    members = stack.members
    member_of = np.repeat(np.arange(len(members)), [m.batch for m in members])
    slots = np.maximum(slots, 0)
    groups = sorted({m.group for m in members})
    out: dict[str, Any] = {}
    for key in ("momentum", "beta2"):
        if len(groups) == 1:
            out[key] = hps[groups[0]][key]
        else:  # a stack shared by groups: each matrix's group value
            index = np.vectorize(lambda i: groups.index(members[member_of[i]].group))(slots)
            table = jnp.stack([hps[g][key] for g in groups])
            out[key] = table[jnp.asarray(pick(index))][:, None, None]
    flags = np.vectorize(lambda i: members[member_of[i]].transposed)(slots)
    if (flags == flags.flat[0]).all():
        out["transposed"] = bool(flags.flat[0])
    else:
        out["transposed"] = jnp.asarray(pick(flags))
    return out


def finish_leaves(plan: TreePlan, configs: dict[str, Any], hps, directions: dict,
                  scales: dict, p_leaves, updates: list) -> None:
    """Steps 8-9 per Muon leaf, in its own layout: ``adaptive``'s ``<U, O>`` (summed over
    the leaf, ``scales``) and the cautious update, into ``updates``."""
    for m in plan.muon:
        hp, o = hps[m.group], directions[m.index]
        if m.index in scales:
            o = o.astype(jnp.float32) * scales[m.index]
        updates[m.index] = leaf_update(o, p_leaves[m.index], hp["lr"], hp["weight_decay"],
                                       rows=m.rows, cols=m.cols, cfg=configs[m.group])


def _stack_step(sp: StackPlan, bufs: MuonBuffers, g: jax.Array, hps, count):
    """One stack, all its matrices: the direction, the new buffers and ``<U, O>``. The
    kernel takes the momentum in the buffer's flat layout (updated in place)."""
    st = sp.stack
    second = bufs.second_moment.reshape((st.size,) + sp.second_shape)
    hp = matrix_hparams(st, hps, np.arange(st.size)[None], lambda t: np.asarray(t)[0])
    o, state, d = muon_step(g, MuonStackState(bufs.momentum, second), hp, st.config, count,
                            st.dtype)
    # The second moment is written once O is computed: the old one is dead by then.
    return o, MuonBuffers(state.momentum, after(state.second_moment.reshape(1, -1), o)), d


def muon_phase(plan: TreePlan, configs: dict[str, Any], hps, count, g_leaves, p_leaves,
               state_muon: tuple[MuonBuffers, ...], scale: jax.Array | None,
               updates: list) -> tuple[MuonBuffers, ...]:
    """Every Muon leaf on one device: fills ``updates``; returns the new state buffers
    (one pair per stack). ``scale``: ``max_grad_norm``'s factor, or None.

    Stacks run one after another: each stacking copy waits for the previous stack's
    direction, so one stack's temporaries are alive at a time.
    """
    bufs = dict(zip(plan.state_keys, state_muon))
    directions, scales, prev = {}, {}, None
    for sp in plan.owner.stacks:
        st = sp.stack
        g = scaled(st.stack([after(g_leaves[m.index], prev) for m in st.members]), scale)
        prev, bufs[sp.state_key], d = _stack_step(sp, bufs[sp.state_key], g, hps, count)
        first = 0
        for m, o in zip(st.members, st.unstack(prev)):
            directions[m.index] = o
            if d is not None:
                scales[m.index] = jnp.sum(d[first:first + m.batch])
            first += m.batch
    finish_leaves(plan, configs, hps, directions, scales, p_leaves, updates)
    return tuple(bufs.values())
