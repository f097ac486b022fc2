"""Checks of the float64 reference (tests/reference.py).

Against the PyTorch peer (../shared/peers/torch_muon_adamw.py, float32 eager) step by
step, and against a few mathematical properties that need no peer.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

try:
    from . import reference as ref
except ImportError:  # tests/ is not a package: pytest puts tests/ on sys.path
    import reference as ref

# ../shared/peers of the checkout, or of a directory above it (a git worktree's).
PEERS = next((d / "shared" / "peers" for d in Path(__file__).resolve().parents[1:]
              if (d / "shared" / "peers").is_dir()), Path("shared/peers"))

MUON_HP = {"lr": 0.02, "momentum": 0.95, "beta2": 0.9, "weight_decay": 0.1, "ns_steps": 5}
ADAMW_HP = {"lr": 0.01, "b1": 0.8, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
STEPS = 5
# Spec tolerance for float32. Holds (~4e-6 measured) for these small matrices only: at
# e.g. 512x2048 the float32 peer is ~3e-5 from exact math (matmul accumulation through
# Polar Express), and with weight decay a cautious-mask flip (O*P near 0) adds ~5e-4.
RTOL = 1e-5


@pytest.fixture(scope="module")
def peer():
    torch = pytest.importorskip("torch")
    if not (PEERS / "torch_muon_adamw.py").exists():
        pytest.skip(f"peer implementation not found in {PEERS}")
    sys.path.insert(0, str(PEERS))
    try:
        import torch_muon_adamw
    finally:
        sys.path.remove(str(PEERS))
    return torch, torch_muon_adamw.TorchMuonAdamW


def _rel(a, b):
    return np.linalg.norm(a - b) / np.linalg.norm(b)


@pytest.mark.parametrize("eq_renorm", [True, False], ids=["current", "march2026"])
@pytest.mark.parametrize("shape", [(32, 32), (48, 16), (16, 48)], ids=["sq", "tall", "wide"])
def test_muon_matches_torch_peer(peer, shape, eq_renorm):
    torch, TorchMuonAdamW = peer
    R, C = shape
    rng = np.random.default_rng(R * 100 + C)
    P = rng.standard_normal(shape) / np.sqrt(C)
    buf, s = ref.init_muon_state(R, C)

    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32))
    group = {"kind": "muon", "params": [p], **MUON_HP}
    opt = TorchMuonAdamW([group], compile=False, equilibrate=eq_renorm,
                         renormalize=eq_renorm, compute_dtype=torch.float32)
    for _ in range(STEPS):
        G = rng.standard_normal(shape)
        # the same float32 inputs for both; the reference is run on them in float64
        G32, P32, buf32, s32 = (x.astype(np.float32) for x in (G, P, buf, s))
        P_new, buf, s = ref.muon_step(G32, P32, buf32, s32, **MUON_HP,
                                      row_equilibration=eq_renorm, renormalize=eq_renorm)

        with torch.no_grad():
            p.copy_(torch.from_numpy(P32))
        p.grad = torch.from_numpy(G32.copy())
        opt.state[p] = {"buf": torch.from_numpy(buf32[None].copy()),
                        "s": torch.from_numpy(s32[None].copy())}
        opt.step()
        st = opt.state[p]

        assert _rel(p.detach().double().numpy() - P32, P_new - P32) < RTOL
        assert _rel(st["buf"][0].numpy(), buf) < RTOL
        assert _rel(st["s"][0].numpy(), s) < RTOL
        P = P_new


def test_adamw_matches_torch_peer(peer):
    torch, TorchMuonAdamW = peer
    shape = (7, 5)
    rng = np.random.default_rng(0)
    p_ = rng.standard_normal(shape)
    m = np.zeros(shape)
    v = np.zeros(shape)

    p = torch.nn.Parameter(torch.zeros(shape, dtype=torch.float32))
    b1, b2 = ADAMW_HP["b1"], ADAMW_HP["b2"]
    group = {"kind": "adamw", "params": [p], "lr": ADAMW_HP["lr"], "betas": (b1, b2),
             "eps": ADAMW_HP["eps"], "weight_decay": ADAMW_HP["weight_decay"]}
    opt = TorchMuonAdamW([group], compile=False, compute_dtype=torch.float32)
    for t in range(1, STEPS + 1):
        g = rng.standard_normal(shape)
        g32, p32, m32, v32 = (x.astype(np.float32) for x in (g, p_, m, v))
        p_new, m, v = ref.adamw_step(p32, g32, m32, v32, t, **ADAMW_HP)

        with torch.no_grad():
            p.copy_(torch.from_numpy(p32))
        p.grad = torch.from_numpy(g32.copy())
        opt.state[p] = {"t": t - 1, "m": torch.from_numpy(m32.copy()),
                        "v": torch.from_numpy(v32.copy())}
        opt.step()

        assert _rel(p.detach().double().numpy() - p32, p_new - p32) < RTOL
        assert _rel(opt.state[p]["m"].numpy(), m) < RTOL
        assert _rel(opt.state[p]["v"].numpy(), v) < RTOL
        p_ = p_new


def test_adamw_matches_torch_optim_adamw_float64():
    """Spec §2 says the rule is torch.optim.AdamW; check it in float64, tightly."""
    torch = pytest.importorskip("torch")
    rng = np.random.default_rng(1)
    shape = (4, 6)
    p0 = rng.standard_normal(shape)
    p = torch.nn.Parameter(torch.from_numpy(p0.copy()))
    opt = torch.optim.AdamW([p], lr=0.03, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.2)
    ours, m, v = p0, np.zeros(shape), np.zeros(shape)
    for t in range(1, STEPS + 1):
        g = rng.standard_normal(shape)
        p.grad = torch.from_numpy(g.copy())
        opt.step()
        ours, m, v = ref.adamw_step(ours, g, m, v, t, lr=0.03, b1=0.9, b2=0.99, eps=1e-8,
                                    weight_decay=0.2)
        np.testing.assert_allclose(p.detach().numpy(), ours, rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("shape", [(64, 32), (32, 64), (40, 40)])
def test_polar_express_orthogonalizes(shape):
    rng = np.random.default_rng(2)
    if shape[0] == shape[1]:
        # a random square Gaussian can be nearly singular; use a conditioned one
        Q1, _ = np.linalg.qr(rng.standard_normal(shape))
        Q2, _ = np.linalg.qr(rng.standard_normal(shape))
        G = Q1 @ np.diag(np.geomspace(1.0, 1e-2, shape[0])) @ Q2
    else:
        G = rng.standard_normal(shape)
    X = ref.polar_express(G, 5)
    sv = np.linalg.svd(X, compute_uv=False)
    assert sv.min() > 0.6 and sv.max() < 1.2, sv
    # same singular vectors as G: X ~ U f(S) V^T, so U^T X V is diagonal
    U, _, Vt = np.linalg.svd(G, full_matrices=False)
    D = U.T @ X @ Vt.T
    np.testing.assert_allclose(D - np.diag(np.diag(D)), 0.0, atol=1e-10)


def test_polar_express_transpose_equivariant():
    """Tall and wide branches compute the same function: pe(X.T) == pe(X).T."""
    rng = np.random.default_rng(3)
    X = rng.standard_normal((48, 16))
    for k in range(6):
        np.testing.assert_allclose(ref.polar_express(X.T, k), ref.polar_express(X, k).T,
                                   rtol=1e-10, atol=1e-12)


def test_polar_express_rejects_too_many_steps():
    with pytest.raises(ValueError):
        ref.polar_express(np.eye(3), 6)


@pytest.mark.parametrize("shape", [(48, 16), (16, 48), (16, 16)])
def test_muon_state_shapes_and_first_step(shape):
    R, C = shape
    buf, s = ref.init_muon_state(R, C)
    assert buf.shape == shape and not buf.any()
    assert s.shape == ((R, 1) if R >= C else (1, C)) and not s.any()
    rng = np.random.default_rng(4)
    G = rng.standard_normal(shape)
    P = rng.standard_normal(shape)
    P_new, buf_new, s_new = ref.muon_step(G, P, buf, s, **MUON_HP)
    assert buf_new.shape == buf.shape and s_new.shape == s.shape
    np.testing.assert_allclose(buf_new, (1 - MUON_HP["momentum"]) * G)
    assert np.all(np.isfinite(P_new))


def test_row_equilibrate():
    rng = np.random.default_rng(5)
    X = rng.standard_normal((24, 8)) * rng.uniform(0.1, 10.0, size=(24, 1))
    Y = ref.row_equilibrate(X)
    rows = np.linalg.norm(Y, axis=1)
    np.testing.assert_allclose(rows, np.linalg.norm(X) / np.sqrt(24), rtol=1e-12)


def test_cautious_weight_decay_only_where_signs_agree():
    """The decay term is -lr_eff * wd * P exactly where O * P >= 0, zero elsewhere."""
    rng = np.random.default_rng(6)
    R, C = 8, 8
    G = rng.standard_normal((R, C))
    P = rng.standard_normal((R, C))
    buf, s = ref.init_muon_state(R, C)
    hp = {**MUON_HP, "weight_decay": 0.5}
    P1, _, _ = ref.muon_step(G, P, buf, s, **hp)
    P0, _, _ = ref.muon_step(G, P, buf, s, **{**hp, "weight_decay": 0.0})
    decay = P1 - P0  # = -lr_eff * wd * P * mask
    O = -(P0 - P)  # proportional to O (lr_eff > 0)
    mask = (O * P) >= 0
    np.testing.assert_allclose(decay[mask], -hp["lr"] * hp["weight_decay"] * P[mask])
    np.testing.assert_array_equal(decay[~mask], 0.0)
