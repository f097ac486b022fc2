"""One device: Muon state in flat per-stack buffers (the engine's) or one array per leaf
(optax's layout, mirroring the params)? The same kernel either way, timed interleaved.

``flat`` is the engine's one-device Muon phase (:func:`muon_optax.step.one_device.muon_phase`):
the kernel updates each stack's momentum in its own buffer, in place. ``per_leaf`` runs
the same kernel on state kept per leaf: stacked before the kernel, split after. Both
jitted with the state donated; ``full_step`` (the whole ``tx.update``) gives the scale.
Printed: medians, the per-rep ratio per_leaf / flat, and each program's temporaries.

  PYTHONPATH=. python benchmarks/state_layout.py                 # d256x4, 20 reps
  PYTHONPATH=. python benchmarks/state_layout.py --set d512x8 --reps 10
"""

from __future__ import annotations

import argparse
import statistics

import jax
import jax.numpy as jnp
import numpy as np

import muon_optax
from benchmarks import common
from muon_optax.rule.muon import MuonStackState
from muon_optax.rule.order import after
from muon_optax.step import one_device
from muon_optax.step.matrices import finish_leaves, matrix_hparams


def per_leaf_phase(plan, configs, count, mom, sec, g_leaves, p_leaves):
    """The one-device Muon phase with its state one array per leaf (momentum
    ``(batch, R, C)``, second moment ``(batch,) + second_shape``)."""
    hps = {n: c.at(count) for n, c in configs.items()}
    prev, outs, new_m, new_s = None, {}, dict(mom), dict(sec)
    for sp in plan.owner.stacks:
        st = sp.stack
        g = st.stack([after(g_leaves[m.index], prev) for m in st.members])
        state = MuonStackState(jnp.concatenate([mom[m.index] for m in st.members]),
                               jnp.concatenate([sec[m.index] for m in st.members]))
        hp = matrix_hparams(st, hps, np.arange(st.size)[None], lambda t: t[0])
        prev, state, _ = st.config.step(g, state, hp, count, st.dtype)
        first = 0
        for m, o in zip(st.members, st.unstack(prev)):
            outs[m.index] = o
            new_m[m.index] = state.momentum[first:first + m.batch]
            new_s[m.index] = state.second_moment[first:first + m.batch]
            first += m.batch
    updates = [None] * len(g_leaves)
    finish_leaves(plan, configs, hps, outs, {}, p_leaves, updates)
    return [updates[m.index] for m in plan.muon], new_m, new_s


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--set", default="d256x4", help="nanochat-like set d<width>x<layers>")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args(argv)
    width, layers = common.parse_set(args.set)
    params = jax.tree.map(jnp.asarray, common.nanochat_params(width, layers, 4096))
    grads = jax.tree.map(jnp.asarray, common.random_grads(params))
    tx = muon_optax.muon_adamw(common.nanochat_groups(width), common.nanochat_labels(params))
    plan, configs, count = tx.init.plan(params), tx.init.options.configs, jnp.int32(3)
    g_leaves, p_leaves = (plan.treedef.flatten_up_to(t) for t in (grads, params))

    def flat(bufs):
        updates = [None] * len(g_leaves)
        hps = {n: c.at(count) for n, c in configs.items()}
        new = one_device.muon_phase(plan, configs, hps, count, g_leaves, p_leaves, bufs, None,
                                updates)
        return [updates[m.index] for m in plan.muon], new

    def zeros():
        mom = {m.index: jnp.zeros((m.batch, sp.stack.rows, sp.stack.cols))
               for sp in plan.owner.stacks for m in sp.stack.members}
        sec = {m.index: jnp.zeros((m.batch,) + sp.second_shape)
               for sp in plan.owner.stacks for m in sp.stack.members}
        return mom, sec

    def leafwise(mom, sec):
        return per_leaf_phase(plan, configs, count, mom, sec, g_leaves, p_leaves)

    fa = jax.jit(flat, donate_argnums=(0,))
    fb = jax.jit(leafwise, donate_argnums=(0, 1))
    step = jax.jit(lambda s: tx.update(grads, s, params), donate_argnums=(0,))
    same = all(bool(jnp.array_equal(a, b)) for a, b in
               zip(jax.jit(flat)(tx.init(params).muon)[0], jax.jit(leafwise)(*zeros())[0]))
    compiled = {"flat": fa.lower(tx.init(params).muon).compile(),
                "per_leaf": fb.lower(*zeros()).compile()}
    temp = {k: f"{c.memory_analysis().temp_size_in_bytes / common.MB:.1f}"
            for k, c in compiled.items()}
    boxes = {"flat": [tx.init(params).muon], "per_leaf": list(zeros()),
             "full_step": [tx.init(params)]}

    def caller(name, fn):
        def call():
            out = fn(*boxes[name])
            boxes[name][:] = out[1:] if name != "full_step" else [out[1]]
            jax.block_until_ready(boxes[name])
        return call

    calls = {"flat": caller("flat", fa), "per_leaf": caller("per_leaf", fb),
             "full_step": caller("full_step", step)}
    for call in calls.values():
        call()
        call()
    times = common.time_interleaved(calls, args.reps)
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    r = common.ratio_stats(times["per_leaf"], times["flat"])
    print(f"# state layout, {args.set}, {args.reps} interleaved reps; {common.machine_line()}")
    print(f"same updates: {same}")
    print(common.md_table(["program", "median ms", "temp MiB"],
                          [(k, f"{v:.1f}", temp.get(k, "-")) for k, v in med.items()], "lrr"))
    print(f"\nper_leaf / flat: per-rep median {r['median']:.3f} (min {r['min']:.3f}, max "
          f"{r['max']:.3f}); difference {(med['per_leaf'] - med['flat']) / med['full_step']:+.1%}"
          " of the full step")


if __name__ == "__main__":
    main()
