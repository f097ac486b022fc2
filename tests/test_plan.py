"""The owner plan: balance against the exact whole-matrix optimum, and its layouts.

No devices needed: plans for up to 256 devices are static (muon_optax.estimate).
"""

import re
import sys
from pathlib import Path

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import muon_optax
from muon_optax.plan.owners import assign_owners, slots_from_owners
from muon_optax.plan.plan import SPLIT_MOMENTS_MIN_DEVICES

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))
from benchmarks.common import (  # noqa: E402  (one copy)
    busiest_over_optimum,
    fsdp_spec,
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


def test_tall_matrices_are_stored_wide_where_loaded_a_chunk_at_a_time():
    """Under FSDP's exchange, which assembles each chunk from pieces, a tall matrix is
    stored with its long side last: an MLP's c_fc (in, out) and c_proj (4w, w) join one
    stack, one program. On one device and under ZeRO-2's gather, which read whole leaves,
    each stays as laid out."""
    params = nanochat_blocks(1)["blocks"]["0"]["mlp"]     # c_fc (64, 256), c_proj (256, 64)
    def labels(p):
        return jax.tree.map(lambda _: "matrix", p)
    mesh = jax.make_mesh((8,), ("data",), devices=jax.devices()[:8])
    specs = jax.tree.map(lambda x: fsdp_spec(x.shape, 8), params)
    for tx, n, wide in [
            (muon_optax.muon_adamw(GROUPS, labels), None, False),
            (muon_optax.muon_adamw(GROUPS, labels, axis_name="data", mesh=mesh,
                                   param_specs=specs), None, True),
            (muon_optax.muon_adamw(GROUPS, labels, axis_name="data"), 8, False)]:
        rows = {r["path"]: r for r in muon_optax.describe(tx, params, num_devices=n,
                                                           file=None)}
        fc, proj = rows["c_fc"], rows["c_proj"]
        assert fc["stored"] == (64, 256, "transposed"), fc   # (out, in) transposed
        if wide:
            assert proj["stored"] == (64, 256, "") and proj["stack"] == fc["stack"], proj
        else:
            assert proj["stored"] == (256, 64, "transposed") and proj["stack"] != fc["stack"]


@pytest.mark.parametrize("n", [2, 3, 4])
def test_mesh_form_splits_whole_params_adamw_moments_from_4_devices(n):
    """Under mesh=, a param laid out whole has its AdamW moments split over the owners only
    from 4 devices on: below, its update gathered whole beside the share it comes from would
    hold more than the split saves. The step then gathers no AdamW update. ZeRO-2 splits them
    on any device count, as nanochat does."""
    params = sp.make_params()
    mesh = jax.make_mesh((n,), ("data",), devices=jax.devices()[:n])
    kw = dict(dimension_numbers=sp.DIMS, axis_name="data")
    jit_tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, mesh=mesh, param_specs=P(), **kw)
    zero2 = muon_optax.muon_adamw(sp.groups(), sp.LABELS, **kw)
    split = n >= SPLIT_MOMENTS_MIN_DEVICES
    assert split == (n == 4)
    for tx, want in ((jit_tx, split), (zero2, True)):
        rows = {r["path"]: r for r in muon_optax.describe(tx, params, num_devices=n, file=None)}
        assert [rows[k]["split"] != "replicated" for k in ("embed", "head")] == [want] * 2
    specs = muon_optax.state_specs(jit_tx, params, mesh)
    assert [specs.mu[k] != P() for k in ("embed", "head")] == [split] * 2, specs.mu
    # estimate plans the same: a device's state holds the moments whole, or a share
    whole = muon_optax.estimate(jit_tx, params, n, param_specs=P())["state_bytes"][0]
    shared = muon_optax.estimate(zero2, params, n)["state_bytes"][0]
    assert (whole == shared) == split, (whole, shared)
    hlo = jax.jit(jit_tx.update).lower(params, jit_tx.init(params), params).compile().as_text()
    gathered = re.findall(r"= f32\[(\d+),(13|40)\]\{[^}]*\} all-gather", hlo)
    assert len(gathered) == (2 if split else 0), gathered


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
