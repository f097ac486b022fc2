"""The Muon step's arithmetic (muon_optax/muon.py) in the dtypes accelerators use."""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax
from muon_optax import MuonDimensionNumbers, polar

try:
    from . import reference as ref
except ImportError:  # plain `pytest` rootdir imports
    import reference as ref

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
    monkeypatch.setattr(polar, "CPU_PER_MATRIX_MAX", 0)
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

    from muon_optax.muon import cautious_update

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

    monkeypatch.setattr(polar, "CPU_PER_MATRIX_MAX", 0)
    params = {"w": jnp.ones((3, 16, 48), param_dtype), "v": jnp.ones((48, 16), param_dtype),
              "b": jnp.ones(16, param_dtype)}
    groups = {"m": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                        weight_decay=0.1, compute_dtype=jnp.bfloat16),
              "a": dict(kind="adamw", lr=1e-3, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)}
    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(matrix="m", other="a"))
    jaxpr = str(jax.make_jaxpr(tx.update)(params, tx.init(params), params))
    assert "bf16" in jaxpr
    assert not re.search(r":bf16\[\]", jaxpr), sorted(set(re.findall(r"\S+:bf16\[\]", jaxpr)))
