"""Portable optimizer state: a run moves between device counts and modes, exactly.

Every device gets the same gradient (the mean of the problem's per-device gradients),
so each mode's step equals the one-device step up to float rounding, and a run that
hops 1 -> ZeRO-2 on 4 -> FSDP on 8 -> mesh= on 2 -> 1 device, through export_state and
import_state, must follow the uninterrupted one-device run.
"""

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")


def mean_grads(step):
    return sp.mean_grads(sp.device_grads(step, range(4)), np.float32)


class Single:
    def __init__(self):
        self.tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS)
        self.update = jax.jit(self.tx.update, compiler_options=sp.FAST_COMPILE)

    def place(self, params, state):
        return params, state

    def step(self, params, state, s):
        u, state = self.update(mean_grads(s), state, params)
        return optax.apply_updates(params, u), state


class ZeRO2:
    """shard_map form on N devices, every device holding the mean gradient."""

    def __init__(self, n):
        self.n, self.tx = n, sp.make_tx("data")
        self.mesh, _, self.compiled, self.specs, _ = sp.sharded((n,))

    def place(self, params, state):
        return params, jax.tree.map(lambda spec, x: jax.device_put(
            x, NamedSharding(self.mesh, spec)), self.specs, state,
            is_leaf=lambda x: isinstance(x, P))

    def step(self, params, state, s):
        g = jax.tree.map(lambda x: np.repeat(x[None], self.n, 0), mean_grads(s))
        return self.compiled(params, state, g)


class Meshed:
    """mesh= under plain jit; params FSDP-split (fsdp=True) or replicated, Explicit axes."""

    def __init__(self, n, fsdp):
        self.mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                                  devices=jax.devices()[:n])
        self.specs = sp.fsdp_specs(sp.make_params(), n) if fsdp else None
        self.tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS,
                                        axis_name="data", mesh=self.mesh)

        def apply(p, st, g):
            u, st = self.tx.update(g, st, p)
            return optax.apply_updates(p, u), st
        self.apply = jax.jit(apply, compiler_options=sp.FAST_COMPILE)

    def _put(self, tree):
        specs = self.specs or jax.tree.map(lambda _: P(), tree)
        return jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(self.mesh, s)),
                            tree, specs)

    def place(self, params, state):
        return self._put(params), state

    def step(self, params, state, s):
        return self.apply(params, state, self._put(mean_grads(s)))


def test_state_hops_device_counts_and_modes_and_continues_exactly():
    params0 = sp.make_params()
    single = Single()
    want, want_state = params0, single.tx.init(params0)
    for s in range(8):
        want, want_state = single.step(want, want_state, s)

    hops = [Single(), ZeRO2(4), Meshed(8, fsdp=True), Meshed(2, fsdp=False), Single()]
    params, portable = params0, None
    for i, mode in enumerate(hops):
        if portable is None:
            state = mode.tx.init(params)
        else:
            n = getattr(mode, "n", None)
            state = muon_optax.import_state(mode.tx, portable, params, num_devices=n)
        params, state = mode.place(params, state)
        for s in (2 * i, 2 * i + 1) if i < 4 else ():
            params, state = mode.step(params, state, s)
        portable = jax.device_get(muon_optax.export_state(mode.tx, state, params))
        params = jax.device_get(params)

    for path, got in jax.tree_util.tree_leaves_with_path(params):
        w = np.asarray(dict(jax.tree_util.tree_leaves_with_path(want))[path], np.float64)
        p0 = np.asarray(dict(jax.tree_util.tree_leaves_with_path(params0))[path], np.float64)
        err = np.linalg.norm(np.asarray(got, np.float64) - w)
        assert err <= 1e-5 * np.linalg.norm(w - p0), (jax.tree_util.keystr(path), err)
    final = muon_optax.export_state(single.tx, want_state, want)
    for name in ("momentum", "second_moment", "mu", "nu"):
        for a, b in zip(jax.tree.leaves(portable[name]), jax.tree.leaves(final[name])):
            np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6 * np.abs(b).max(),
                                       err_msg=name)


def test_export_and_import_run_under_jit():
    tx = sp.make_tx("data")
    params = sp.make_params()
    state = muon_optax.import_state(tx, muon_optax.export_state(
        sp.make_tx(None), sp.make_tx(None).init(params), params), params, num_devices=3)
    exported = jax.jit(lambda s: muon_optax.export_state(tx, s, params))(state)
    back = jax.jit(lambda e: muon_optax.import_state(tx, e, params, num_devices=3))(exported)
    assert jax.tree.structure(back) == jax.tree.structure(state)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        assert a.shape == b.shape


def test_import_errors_name_the_path():
    params = sp.make_params()
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS)
    portable = muon_optax.export_state(tx, tx.init(params), params)
    other = dict(params, head=np.zeros((5, 5), np.float32))
    with pytest.raises(ValueError, match="'head'"):
        muon_optax.import_state(tx, portable, other)
    relabelled = dict(sp.LABELS, embed="muon")
    tx2 = muon_optax.muon_adamw(sp.groups(), relabelled, dimension_numbers=sp.DIMS)
    with pytest.raises(ValueError, match="'embed'"):
        muon_optax.import_state(tx2, portable, params)
    with pytest.raises(ValueError, match="export_state"):
        muon_optax.import_state(tx, {"count": 0}, params)
    with pytest.raises(ValueError, match="num_devices"):
        muon_optax.import_state(sp.make_tx("data"), portable, params)
    with pytest.raises(ValueError, match="state was made for other params"):
        muon_optax.export_state(tx, tx.init(params), other)
