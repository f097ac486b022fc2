"""The owner plan: balance against the exact whole-matrix optimum, and its layouts.

No devices needed: plans for up to 256 devices are static (muon_optax.estimate).
"""

import sys
from pathlib import Path

import jax
import numpy as np
import pytest

import muon_optax
from muon_optax.plan.owners import assign_owners, slots_from_owners

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.common import (  # noqa: E402  (one copy)
    busiest_over_optimum,
    nanochat_blocks,
    stack_costs,
)

GROUPS = {"matrix": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                         weight_decay=0.2)}


@pytest.mark.parametrize("depth", [12, 20, 26, 32])
def test_balance_within_5_percent_of_the_exact_optimum_up_to_256_devices(depth):
    params = nanochat_blocks(depth)
    tx = muon_optax.muon_adamw(GROUPS, lambda p: jax.tree.map(lambda _: "matrix", p),
                               axis_name="data")
    for n in (8, 16, 32, 64, 128, 256):
        assert [k for _, k, _, _ in stack_costs(tx, params, n)] == [2 * depth, 4 * depth]
        flops, state = busiest_over_optimum(tx, params, n)
        assert flops <= 1.05 and state <= 1.05, (n, flops, state)


def test_per_stack_padding_is_worse_than_the_plan():
    # The case the plan exists for: d20 on 64 devices. Padding each stack to a multiple
    # of N (one slot per device per stack) would give each device a big and a small
    # matrix's state: 1.25x the optimum; the plan reaches it.
    params = nanochat_blocks(20)
    tx = muon_optax.muon_adamw(GROUPS, lambda p: jax.tree.map(lambda _: "matrix", p),
                               axis_name="data")
    est = muon_optax.estimate(tx, params, 64)
    w = 64 * 20
    per_stack = 4 * ((4 * w * w + w) + (w * w + w))
    assert est["state_bytes"][0] - 4 <= per_stack / 1.2


def test_assign_owners_pins_and_balances():
    owners = assign_owners([4, 4, 1, 1, 1, 1], [4, 4, 1, 1, 1, 1], 2, fixed=[-1, -1, 0, 0, -1, -1])
    loads = np.bincount(owners, weights=[4, 4, 1, 1, 1, 1], minlength=2)
    assert owners[2] == owners[3] == 0 and sorted(loads) == [6, 6]
    slots = slots_from_owners(owners, 2)
    assert [sorted(r[r >= 0]) for r in slots] == [sorted(np.flatnonzero(owners == d))
                                                   for d in range(2)]


@pytest.mark.parametrize("n", [3, 8])
def test_each_devices_share_holds_its_matrices_back_to_back(n):
    # The ZeRO-2 plan of a nanochat block stack: in every flat buffer (gradients and
    # state), device d's share holds its owned matrices stack after stack, from 0, with no
    # gap or overlap; the buffer is as long as the busiest device's share.
    tx = muon_optax.muon_adamw(GROUPS, lambda p: jax.tree.map(lambda _: "matrix", p),
                               axis_name="data")
    owner = tx.init.plan(nanochat_blocks(2), n).owner
    for ch in [*owner.gather.values(), *owner.momentum.values(), *owner.second.values()]:
        ends = []
        for d in range(n):
            spans = sorted((int(ch.offsets[k, d]),
                            int(ch.offsets[k, d] + owner.stacks[k].counts[d] * ch.sizes[k]))
                           for k in ch.stacks)
            assert spans[0][0] == 0 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            ends.append(spans[-1][1])
        assert ch.length == max(ends)


def test_estimate_errors():
    params = nanochat_blocks(2)
    labels = lambda p: jax.tree.map(lambda _: "matrix", p)  # noqa: E731
    with pytest.raises(ValueError, match="axis_name"):
        muon_optax.estimate(muon_optax.muon_adamw(GROUPS, labels), params, 8)
    with pytest.raises(TypeError, match="chain"):
        muon_optax.estimate(jax.tree_util.Partial(lambda: None), params, 8)
    with pytest.raises(ValueError, match="num_devices"):
        muon_optax.estimate(muon_optax.muon_adamw(GROUPS, labels, axis_name="data"), params, 0)
