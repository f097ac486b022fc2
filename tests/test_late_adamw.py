"""The mesh= form's whole-everywhere AdamW leaves stepped split over the owners, after the
Muon phase: on TPU (forced here on XLA:CPU) their inputs wait for the Muon phase's results
behind an optimization barrier, so that no whole gathered update is held through it; the
steps are the same, bit for bit, as the form other platforms lower."""

import re

import jax
import numpy as np
import pytest
from jax.sharding import AxisType
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
