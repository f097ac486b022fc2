"""The pieces of muon.py: momentum variants, adaptive scaling, lr scales, decoupled decay.

The options of nanochat's rule (``muon``/``muon_adamw`` groups) run against the float64
reference (tests/reference.py); the pieces optax.contrib.muon is made of run against
optax's own transformations.
"""

import sys

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from optax.contrib import MuonDimensionNumbers

import muon_optax
from muon_optax.hparams import MuonConfig

try:
    from .test_optimizer import (
        MIXED,
        MIXED_LABELS,
        assert_changes_close,
        mixed_groups,
        muon_group,
        random_tree,
        run_both,
    )
except ImportError:  # plain `pytest` rootdir imports
    from test_optimizer import (
        MIXED,
        MIXED_LABELS,
        assert_changes_close,
        mixed_groups,
        muon_group,
        random_tree,
        run_both,
    )

M = sys.modules["muon_optax.muon"]  # the module (muon_optax.muon is the constructor)
SHAPES = {"wide": (16, 48), "tall": (40, 24), "square": (24, 24)}


# ----------------------------------------------------------------- muon()'s options


@pytest.mark.parametrize("option", [
    dict(nesterov=False), dict(normuon=False), dict(cautious=False),
    dict(normuon=False, renormalize=False), dict(ns_coeffs="quintic", ns_steps=7),
    dict(ns_coeffs=muon_optax.POLAR_EXPRESS_COEFFS[1:], ns_steps=4),
    dict(preconditioning="aol"),
    # (cautious off: at 4 steps one sign flip of O P near zero moves a 16x48 leaf by 2e-2)
    dict(preconditioning="aol", ns_steps=4, cautious=False),
], ids=lambda d: ",".join(f"{k}={v if not isinstance(v, tuple) else 'table'}"
                          for k, v in d.items()))
def test_options_match_reference(option):
    assert_changes_close(run_both(MIXED, mixed_groups(**option), MIXED_LABELS), 1e-5)


def test_aol_on_torch_layout_square_uses_its_input_side():
    # A square stored (out, in) runs AOL on its stored columns: the same update as the
    # Flax layout's, transposed.
    params = random_tree({"w": (24, 24)})
    grads = random_tree({"w": (24, 24)}, seed=1)
    t = lambda tree: jax.tree.map(jnp.transpose, tree)  # noqa: E731
    flax_tx = muon_optax.muon(0.02, preconditioning="aol", compute_dtype=jnp.float32)
    torch_tx = muon_optax.muon(0.02, preconditioning="aol", compute_dtype=jnp.float32,
                               dimension_numbers=MuonDimensionNumbers(1, 0))
    u_flax, _ = flax_tx.update(grads, flax_tx.init(params), params)
    u_torch, _ = torch_tx.update(t(grads), torch_tx.init(t(params)), t(params))
    np.testing.assert_allclose(u_flax["w"], u_torch["w"].T, rtol=0, atol=1e-7)


def test_mu_dtype_stores_the_momentum_in_it():
    params = random_tree(SHAPES)
    tx = muon_optax.muon(0.02, mu_dtype=jnp.bfloat16, compute_dtype=jnp.float32)
    state = tx.init(params)
    assert {s.momentum.dtype for s in state.muon} == {jnp.dtype(jnp.bfloat16)}
    assert {s.second_moment.dtype for s in state.muon} == {jnp.dtype(jnp.float32)}
    ref = muon_optax.muon(0.02, compute_dtype=jnp.float32)
    grads = random_tree(SHAPES, seed=1)
    u, state = jax.jit(tx.update)(grads, state, params)
    want, _ = ref.update(grads, ref.init(params), params)
    assert {s.momentum.dtype for s in state.muon} == {jnp.dtype(jnp.bfloat16)}
    for k in params:  # one step from zero momentum: bf16 rounding of U only
        np.testing.assert_allclose(u[k], want[k], rtol=0, atol=2e-2 * np.abs(want[k]).max())


def test_normuon_off_keeps_a_token_second_moment():
    state = M.init_stack_state(3, 8, 16, jnp.float32, True,
                               MuonConfig.make(0.1, 0.9, 5, 0.9, 0.0, normuon=False))
    assert state.second_moment.shape == (3, 1, 1)
    assert M.init_stack_state(3, 8, 16, jnp.float32, True).second_moment.shape == (3, 1, 16)


def test_default_leaf_update_is_the_cautious_update():
    o, p = random_tree({"o": (8, 24)})["o"], random_tree({"p": (8, 24)}, seed=1)["p"]
    cfg = MuonConfig.make(0.1, 0.9, 5, 0.9, 0.2)
    lr, wd = jnp.float32(0.02), jnp.float32(0.2)
    chex.assert_trees_all_equal(
        M.leaf_update(o, p, lr, wd, rows=24, cols=8, cfg=cfg),
        M.cautious_update(o, p, lr * M.matrix_lr_scale(24, 8), wd))


# ------------------------------------------------- the pieces of optax.contrib.muon


def _contrib_cfg(**kw):
    return MuonConfig.make(
        1.0, kw.pop("beta", 0.95), kw.pop("ns_steps", 5), 0.0, 0.0, row_equilibration=False,
        renormalize=False, compute_dtype=jnp.float32, polar_method="direct",
        ns_coeffs=kw.pop("ns_coeffs", (3.4445, -4.7750, 2.0315)), normuon=False,
        cautious=False, bias_correction=True, scale_decay=False, optax_ema=True, **kw)


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_momentum_step_matches_optax(nesterov, mu_dtype):
    # With the identity polynomial (1, 0, 0), eps = 0 and adaptive scaling, optax's
    # scale_by_muon returns its bias-corrected momentum U itself.
    x = random_tree({"w": (8, 24)})
    tx = optax.contrib.scale_by_muon(ns_coeffs=(1.0, 0.0, 0.0), ns_steps=1, beta=0.9, eps=0.0,
                                     mu_dtype=mu_dtype, nesterov=nesterov, adaptive=True,
                                     weight_dimension_numbers={"w": MuonDimensionNumbers()})
    state = tx.init(x)
    buf = jnp.zeros((8, 24), mu_dtype or jnp.float32)
    for step in range(5):
        g = random_tree({"w": (8, 24)}, seed=10 + step)
        want, state = tx.update(g, state)
        u, buf32 = M.momentum_step(g["w"], buf, jnp.float32(0.9), nesterov=nesterov,
                                   count=jnp.int32(step), optax_ema=True, complement=0.1)
        buf = buf32.astype(buf.dtype)
        np.testing.assert_allclose(u, want["w"], rtol=2e-6, atol=1e-7)
        np.testing.assert_array_equal(buf, state.mu["w"])


@pytest.mark.parametrize("preconditioning", ["frobenius", "spectral", "aol", "schatten"])
@pytest.mark.parametrize("adaptive", [False, True])
def test_direction_of_a_batched_leaf_matches_scale_by_muon(preconditioning, adaptive):
    # A (3, 16, 40) leaf: 3 matrices, (in, out) = (16, 40). Adaptive scaling sums <U, O>
    # over the whole leaf, which leaf_sum supplies.
    dims = MuonDimensionNumbers(reduction_axis=1, output_axis=2)
    tx = optax.contrib.scale_by_muon(preconditioning=preconditioning, adaptive=adaptive,
                                     weight_dimension_numbers={"w": dims})
    state = tx.init({"w": jnp.zeros((3, 16, 40))})
    cfg = _contrib_cfg(preconditioning=preconditioning, adaptive=adaptive)
    ours = M.init_stack_state(3, 16, 40, jnp.float32, True, cfg)
    total = lambda d: jnp.broadcast_to(jnp.sum(d), d.shape)  # noqa: E731
    for step in range(3):
        g = random_tree({"w": (3, 16, 40)}, seed=step)
        want, state = tx.update(g, state)
        o, ours = M.muon_direction(g["w"], ours, momentum=jnp.float32(0.95),
                                   beta2=jnp.float32(0.0), transposed=True, cfg=cfg,
                                   count=jnp.int32(step), leaf_sum=total)
        np.testing.assert_allclose(o, want["w"], rtol=0, atol=2e-5 * np.abs(want["w"]).max())


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (2, 24, 24)])
def test_matrix_lr_scale_matches_scale_by_shape(shape, consistent_rms):
    from optax.contrib._muon import scale_by_shape

    dims = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
    tx = scale_by_shape(weight_dimension_numbers={"w": dims}, consistent_rms=consistent_rms)
    u, _ = tx.update({"w": jnp.ones(shape)}, tx.init(None))
    cfg = MuonConfig.make(1.0, 0.9, 5, 0.9, 0.0, consistent_rms=consistent_rms)
    fan_in, fan_out = shape[-2:]
    np.testing.assert_allclose(M.matrix_lr_scale(fan_out, fan_in, cfg), u["w"].reshape(-1)[0],
                               rtol=1e-6)


def test_plain_decay_with_a_mask_matches_optax():
    shapes = {"a": (8, 24), "b": (24, 8)}
    o, p = random_tree(shapes), random_tree(shapes, seed=1)
    mask = {"a": True, "b": False}
    lr, wd = optax.linear_schedule(0.1, 0.01, 10), 0.3
    tx = optax.chain(optax.add_decayed_weights(wd, mask), optax.scale_by_learning_rate(lr))
    scale = {k: M.matrix_lr_scale(s[1], s[0]) for k, s in shapes.items()}
    want, _ = tx.update({k: o[k] * scale[k] for k in o}, tx.init(p), p)
    cfg = _contrib_cfg()
    for k, (cols, rows) in shapes.items():
        got = M.leaf_update(o[k], p[k], jnp.float32(lr(0)), jnp.float32(wd * mask[k]),
                            rows=rows, cols=cols, cfg=cfg)
        np.testing.assert_allclose(got, want[k], rtol=1e-6, atol=1e-8)


def test_bias_correction_needs_the_count():
    cfg = _contrib_cfg()
    state = M.init_stack_state(1, 4, 8, jnp.float32, True, cfg)
    with pytest.raises(ValueError, match="count="):
        M.muon_direction(jnp.ones((1, 4, 8)), state, momentum=0.9, beta2=0.0,
                         transposed=True, cfg=cfg)


def test_group_options_run_through_muon_adamw():
    groups = {"m": muon_group(nesterov=False, cautious=False, preconditioning="aol",
                              ns_coeffs="quintic", ns_steps=6)}
    assert_changes_close(run_both(SHAPES, groups, dict.fromkeys(SHAPES, "m")), 1e-5)
