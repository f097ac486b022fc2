"""The Muon step's arithmetic (muon_optax/rule/muon.py): in the dtypes accelerators use, and
its pieces (momentum variants, adaptive scaling, lr scales, decoupled decay).

The options of nanochat's rule (``muon``/``muon_adamw`` groups) run against the float64
reference (tests/reference.py); the pieces optax.contrib.muon is made of run against
optax's own transformations.
"""

import sys
from pathlib import Path

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax
from muon_optax import MuonDimensionNumbers
from muon_optax.rule import platform
from muon_optax.rule.contrib import ContribConfig
from muon_optax.rule.hparams import MuonConfig

try:
    from . import reference as ref
except ImportError:  # plain `pytest` rootdir imports
    import reference as ref
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


# ../shared/peers of the checkout, or of a directory above it (a git worktree's).
PEERS = next((d / "shared" / "peers" for d in Path(__file__).resolve().parents[1:]
              if (d / "shared" / "peers").is_dir()), Path("shared/peers"))
HP = dict(lr=0.02, momentum=0.95, beta2=0.9, weight_decay=0.1, ns_steps=5)
K = 3  # matrices in the stack


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


def _torch_peer():
    """The PyTorch peer's optimizer class, or None without torch or the peer."""
    try:
        import torch
    except ImportError:
        return None, None
    if not (PEERS / "torch_muon_adamw.py").exists():
        return torch, None
    sys.path.insert(0, str(PEERS))
    try:
        import torch_muon_adamw
    finally:
        sys.path.remove(str(PEERS))
    return torch, torch_muon_adamw.TorchMuonAdamW


def _muon_optax_step(P, G, buf, s):
    """One muon_optax step on a (K, R, C) stack in bf16 compute, from the given state."""
    tx = muon_optax.muon(HP["lr"], HP["momentum"], HP["ns_steps"], HP["beta2"],
                         HP["weight_decay"], compute_dtype=jnp.bfloat16,
                         dimension_numbers=MuonDimensionNumbers(reduction_axis=2, output_axis=1))
    state = muon_optax.import_state(tx, dict(count=0, mu=None, nu=None, momentum=buf,
                                             second_moment=s), jnp.asarray(P))
    updates, _ = jax.jit(tx.update)(jnp.asarray(G), state, jnp.asarray(P))
    return np.asarray(updates, np.float64)


def _torch_step(torch, peer_cls, P, G, buf, s):
    params = [torch.nn.Parameter(torch.from_numpy(p.copy())) for p in P]
    opt = peer_cls([dict(kind="muon", params=params, **HP)], compile=False,
                   compute_dtype=torch.bfloat16)
    for p, g in zip(params, G):
        p.grad = torch.from_numpy(g.copy())
    opt.state[params[0]] = {"buf": torch.from_numpy(buf.copy()),
                            "s": torch.from_numpy(s.copy())}
    opt.step()
    return np.stack([p.detach().double().numpy() for p in params]) - P


@pytest.mark.parametrize("shape", [(64, 64), (32, 96)], ids=["square", "wide"])
def test_bf16_compute_step_against_float64_rule_and_torch_peer(shape, monkeypatch):
    # The accelerators' default program on CPU: bf16 polar iteration, one batched
    # (K, R, C) program instead of CPU's per-matrix one.
    monkeypatch.setitem(platform.FORCED, "polar", "tpu")
    torch, peer_cls = _torch_peer()
    rng = np.random.default_rng(sum(shape))
    R, C = shape
    P = (rng.standard_normal((K, R, C)) / np.sqrt(C)).astype(np.float32)
    buf = (0.1 * rng.standard_normal((K, R, C))).astype(np.float32)
    s = (0.01 * rng.random((K, R, 1) if R >= C else (K, 1, C))).astype(np.float32)
    G = rng.standard_normal((K, R, C)).astype(np.float32)
    want = np.stack([ref.muon_step(G[i], P[i], buf[i], s[i], **HP)[0] - P[i]
                     for i in range(K)])
    err = _rel(_muon_optax_step(P, G, buf, s), want)
    # bf16-rounded Polar Express coefficients gave 0.057 to 0.11 here; the rounding
    # of the iterates alone leaves 0.017 to 0.024.
    assert err < 0.03, err
    if peer_cls is None:
        pytest.skip(f"error {err:.4f}; no torch or peer in {PEERS} to compare with")
    peer_err = _rel(_torch_step(torch, peer_cls, P, G, buf, s), want)
    assert err <= peer_err, (err, peer_err)


@pytest.mark.parametrize("p_std,lr", [(0.02, 1e-3), (0.5, 2e-2)])
def test_cautious_update_rounds_bf16_params_once(p_std, lr):
    from test_adamw import assert_rounded_once, rounded_once, to64

    from muon_optax.rule.muon import cautious_update

    # Before: 3.7% (p_std 0.02) and 3.2% (p_std 0.5) of these elements one ulp off.
    keys = jax.random.split(jax.random.PRNGKey(0), 2)
    p = (p_std * jax.random.normal(keys[0], (128, 128))).astype(jnp.bfloat16)
    o = jax.random.normal(keys[1], (128, 128)).astype(jnp.bfloat16)
    u = jax.jit(cautious_update)(o, p, jnp.float32(lr), jnp.float32(0.2))
    assert u.dtype == jnp.bfloat16
    P, O = to64(p), to64(o)
    want = rounded_once(P - lr * O - lr * 0.2 * P * (O * P >= 0))
    assert_rounded_once(p, to64(optax.apply_updates(p, u)), want)


@pytest.mark.parametrize("param_dtype", [jnp.float32, jnp.bfloat16])
def test_bf16_step_has_no_bf16_scalars(param_dtype, monkeypatch):
    # A Python float times a bf16 array is a bf16 literal: no scalar of the rule may be
    # rounded to bf16 anywhere in the step (the polar coefficients were).
    import re

    monkeypatch.setitem(platform.FORCED, "polar", "tpu")
    params = {"w": jnp.ones((3, 16, 48), param_dtype), "v": jnp.ones((48, 16), param_dtype),
              "b": jnp.ones(16, param_dtype)}
    groups = {"m": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                        weight_decay=0.1, compute_dtype=jnp.bfloat16),
              "a": dict(kind="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)}
    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(matrix="m", other="a"))
    jaxpr = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    assert "bf16" in jaxpr
    assert not re.search(r":bf16\[\]", jaxpr), sorted(set(re.findall(r"\S+:bf16\[\]", jaxpr)))


M = sys.modules["muon_optax.rule.muon"]  # the module (muon_optax.muon is the constructor)
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


def test_normuon_off_keeps_one_token_second_moment_per_matrix():
    # Without NorMuon the second moment is unused: one element per matrix, not a row.
    params = random_tree({"a": (8, 16), "b": (3, 8, 16)})
    tx = muon_optax.muon(0.02, normuon=False, dimension_numbers={
        "a": MuonDimensionNumbers(), "b": MuonDimensionNumbers(1, 2)})
    state = tx.init(params)
    assert sum(s.second_moment.size for s in state.muon) == 4
    assert sum(s.momentum.size for s in state.muon) == 4 * 8 * 16


def test_default_leaf_update_is_the_cautious_update():
    o, p = random_tree({"o": (8, 24)})["o"], random_tree({"p": (8, 24)}, seed=1)["p"]
    cfg = MuonConfig.make(0.1, 0.9, 5, 0.9, 0.2)
    lr, wd = jnp.float32(0.02), jnp.float32(0.2)
    chex.assert_trees_all_equal(
        cfg.leaf_update(o, p, lr, wd, rows=24, cols=8),
        M.cautious_update(o, p, lr * M.matrix_lr_scale(24, 8), wd))


def test_nanochat_config_holds_only_muons_arguments():
    # optax's and torch's switches live in rule/contrib.py, not in nanochat's kernel
    import dataclasses
    import inspect

    fields = {f.name for f in dataclasses.fields(MuonConfig)}
    assert fields <= set(inspect.signature(muon_optax.muon).parameters), fields


# ------------------------------------------------- the pieces of optax.contrib.muon


def _contrib_cfg(**kw):
    return ContribConfig.make(1.0, kw.pop("beta", 0.95), 0.0, ((3.4445, -4.7750, 2.0315),) * 5,
                              compute_dtype=jnp.float32, **kw)


@pytest.mark.parametrize("consistent_rms", [None, 0.2])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (2, 24, 24)])
def test_matrix_lr_scale_matches_scale_by_shape(shape, consistent_rms):
    from optax.contrib._muon import scale_by_shape

    dims = MuonDimensionNumbers(reduction_axis=-2, output_axis=-1)
    tx = scale_by_shape(weight_dimension_numbers={"w": dims}, consistent_rms=consistent_rms)
    u, _ = tx.update({"w": jnp.ones(shape)}, tx.init(None))
    cfg = _contrib_cfg(consistent_rms=consistent_rms)
    fan_in, fan_out = shape[-2:]
    np.testing.assert_allclose(cfg.lr_scale(fan_out, fan_in), u["w"].reshape(-1)[0],
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
        got = cfg.leaf_update(o[k], p[k], jnp.float32(lr(0)), jnp.float32(wd * mask[k]),
                              rows=rows, cols=cols)
        np.testing.assert_allclose(got, want[k], rtol=1e-6, atol=1e-8)


def test_group_options_run_through_muon_adamw():
    groups = {"m": muon_group(nesterov=False, cautious=False, preconditioning="aol",
                              ns_coeffs="quintic", ns_steps=6)}
    assert_changes_close(run_both(SHAPES, groups, dict.fromkeys(SHAPES, "m")), 1e-5)
