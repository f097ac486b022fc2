"""Balanced owners: which device runs each Muon matrix's polar iteration and holds its state."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np


def lower_bound(costs: np.ndarray, n: int) -> float:
    """A lower bound on the busiest device's load: the mean, and for every ``k``, ``k + 1``
    times the ``(k n + 1)``-th largest (``k = 0``: the largest unit; some device gets ``k + 1``
    of those: 24 big matrices on 16 devices put two on one, which the mean does not see)."""
    p = np.sort(np.asarray(costs, float))[::-1]
    tops = p[::n] * np.arange(1, len(p[::n]) + 1)
    return max(p.sum() / n, tops.max(initial=0.0), 1e-30)


def assign_owners(flops: Sequence[float], state: Sequence[float], num_devices: int,
                  fixed: Sequence[int] | None = None) -> np.ndarray:
    """Owner of every matrix: greedy longest-processing-time across all stacks, each to the
    device with the least FLOPs so far. Where FLOPs and state disagree (many tiny matrices beside
    a few large ones), a greedy balancing both over their lower bounds can do better: the one
    with the smaller worse ratio is kept. ``fixed[i] >= 0`` pins matrix ``i`` where it lives."""
    flops, state = np.asarray(flops, float), np.asarray(state, float)
    owners = np.full(len(flops), -1, np.int64) if fixed is None else np.asarray(fixed, np.int64)
    order = sorted(np.flatnonzero(owners < 0).tolist(), key=lambda i: (-flops[i], -state[i], i))
    f_bound, s_bound = lower_bound(flops, num_devices), lower_bound(state, num_devices)
    pinned, index = owners >= 0, np.arange(num_devices)

    def greedy(balance_both: bool) -> np.ndarray:
        out = owners.copy()
        load, held = np.zeros(num_devices), np.zeros(num_devices)
        np.add.at(load, owners[pinned], flops[pinned])
        np.add.at(held, owners[pinned], state[pinned])
        for i in order:
            if balance_both:
                after = np.maximum((load + flops[i]) / f_bound, (held + state[i]) / s_bound)
                d = np.lexsort((index, load + held, after))[0]
            else:
                d = np.lexsort((index, held, load))[0]
            out[i] = d
            load[d] += flops[i]
            held[d] += state[i]
        return out

    def worst(o: np.ndarray) -> float:
        f = np.bincount(o, flops, minlength=num_devices).max() / f_bound
        s = np.bincount(o, state, minlength=num_devices).max() / s_bound
        return max(f, s)

    return min([greedy(False), greedy(True)], key=worst) if len(flops) else owners


def slots_from_owners(owners: np.ndarray, num_devices: int) -> np.ndarray:
    """``(N, S)`` table of each device's owned matrices in stack order, ``-1`` padded."""
    per_device = [np.flatnonzero(owners == d) for d in range(num_devices)]
    slots = np.full((num_devices, max(map(len, per_device), default=0)), -1, np.int64)
    for d, p in enumerate(per_device):
        slots[d, :len(p)] = p
    return slots
