"""The whole-everywhere AdamW leaves stepped split over the owners, after the Muon phase.
The mesh= form: on TPU (forced here on XLA:CPU) their inputs wait for the Muon phase's
results behind an optimization barrier, so that no whole gathered update is held through
it; ZeRO-2: they wait for one element of every (whole) Muon update. The steps are the
same, bit for bit, as the form other platforms lower."""

import re

import jax
import jax.extend
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax
from muon_optax.rule import platform

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 4, reason="needs 4 devices")

N = 4


def _steps(monkeypatch, tpu: bool):
    """Two steps of params replicated over 4 devices (``embed`` and ``head`` split AdamW
    leaves), the step lowered (text) and the plan."""
    if tpu:
        monkeypatch.setitem(platform.FORCED, "late_adamw", "tpu")
    mesh = jax.make_mesh((N,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:N])
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS,
                               axis_name="data", mesh=mesh)
    specs = jax.tree.map(lambda _: P(), sp.make_params())
    out, step, args = sp.jit_steps(tx, mesh, specs, N)
    return out, step.lower(*args).as_text(), tx.init.plan(args[0])


def test_split_adamw_leaves_wait_for_the_muon_phase_on_tpu(monkeypatch):
    whole, text, plan = _steps(monkeypatch, tpu=False)
    late = [a for a in plan.adamw if a.axis is not None and not a.local]
    assert sorted(a.path for a in late) == ["embed", "head"]
    assert "optimization_barrier" not in text            # other platforms: no barrier
    with monkeypatch.context() as m:
        forced, text, _ = _steps(m, tpu=True)
    for a, b in zip(jax.tree.leaves(whole), jax.tree.leaves(forced)):
        np.testing.assert_array_equal(a, b)
    # TPU: one barrier, the split leaves' gradients, params and moments (4 each) beside
    # the Muon phase's results (each Muon leaf's update, the state buffers)
    (barrier,) = re.findall(r"stablehlo\.optimization_barrier (.*?) :", text)
    n_muon = len(plan.muon) + 2 * len(plan.state_keys)
    assert barrier.count("%") == 4 * len(late) + n_muon, barrier


def _flow(jaxpr, ins: list) -> list:
    """For each output of ``jaxpr``, the union of the labels (``ins``: a set per input) of
    the inputs it is computed from, looking into nested calls and ``cond`` branches (any
    other nested jaxpr counts each of its outputs as made from all of its inputs)."""
    env = dict(zip(jaxpr.invars, ins))

    def read(v):
        return frozenset() if isinstance(v, jax.extend.core.Literal) else env.get(v, frozenset())

    for eqn in jaxpr.eqns:
        args = [read(v) for v in eqn.invars]
        subs = [p for p in eqn.params.values() if hasattr(p, "eqns")]
        if eqn.primitive.name == "cond":
            per_branch = [_flow(b, args[1:]) for b in eqn.params["branches"]]
            outs = [args[0].union(*sets) for sets in zip(*per_branch)]
        elif (len(subs) == 1 and len(subs[0].invars) == len(args)
              and len(subs[0].outvars) == len(eqn.outvars)):
            outs = _flow(subs[0], args)
        else:
            outs = [frozenset().union(*args)] * len(eqn.outvars)
        env.update(zip(eqn.outvars, outs))
    return [read(v) for v in jaxpr.outvars]


def _new_params_made_from(monkeypatch, form: str) -> dict[str, frozenset]:
    """ZeRO-2 (``shard_map``) with the ``late_adamw`` site's ``form``: for each new
    param, the paths of the step's inputs it is computed from."""
    monkeypatch.setitem(platform.FORCED, "late_adamw", form)
    mesh = sp.make_mesh((N,))
    params = sp.make_params()
    init, step, _ = sp.sharded_fns(sp.make_tx(), params, mesh)
    args = (params, init(params), sp.device_grads(0, range(N)))
    paths = [muon_optax.path_str(p) for p, _ in jax.tree_util.tree_flatten_with_path(args)[0]]
    outs = _flow(jax.make_jaxpr(step)(*args).jaxpr, [frozenset([p]) for p in paths])
    return {muon_optax.path_str(p): d for (p, _), d in zip(
        jax.tree_util.tree_flatten_with_path(params)[0], outs)}


def test_zero2_split_adamw_leaves_wait_for_every_muon_update_on_tpu(monkeypatch):
    """ZeRO-2 on TPU: the split AdamW leaves' updates, gathered whole for
    ``apply_updates``, are computed from one element of every Muon leaf's update, so
    after the Muon phase (stepped before it, the two whole gathered updates of nanochat
    d768 were held through it: 574 MiB of temporaries on v5e 8 chips, 384 this way).
    The small all-reduced leaves are not held back; on CPU nothing is."""
    made_from = _new_params_made_from(monkeypatch, "tpu")
    muon_params = {f"0/{k}" for k in made_from if k.startswith("blocks/")}
    assert len(muon_params) == 7
    for leaf in ("embed", "head"):
        assert muon_params <= made_from[leaf], sorted(muon_params - made_from[leaf])
    for leaf in sp.SMALL:
        assert not muon_params & made_from[leaf], leaf
    made_from = _new_params_made_from(monkeypatch, "cpu")
    for leaf in ("embed", "head"):
        assert not muon_params & made_from[leaf], leaf


def test_zero2_tpu_barrier_gives_the_same_steps(monkeypatch):
    mesh = sp.make_mesh((N,))
    params = sp.make_params()

    def two_steps():
        init, step, _ = sp.sharded_fns(sp.make_tx(), params, mesh)
        # The params placed as the step returns them: one compile, not a second for the
        # NumPy params of the first step.
        p, state = jax.device_put(params, NamedSharding(mesh, P())), init(params)
        for s in range(2):
            p, state = step(p, state, sp.device_grads(s, range(N)))
        return jax.tree.map(np.asarray, (p, state))

    plain = two_steps()
    monkeypatch.setitem(platform.FORCED, "late_adamw", "tpu")
    forced = two_steps()
    for a, b in zip(jax.tree.leaves(plain), jax.tree.leaves(forced)):
        np.testing.assert_array_equal(a, b)
