"""Float64 NumPy reference of the MuonAdamW update rule (../shared/spec/muon-adamw.md, §2-§3).

Ground truth for the tests: exact math, no dtype simulation. Every input is cast to
float64 and every result is float64; the spec's ``compute_dtype`` and parameter-dtype
casts are deliberately not reproduced. One call = one optimizer step for ONE array:

* ``adamw_step`` - §2, any shape, ``t`` is the 1-based step count.
* ``muon_step`` - §3 for one matrix in PyTorch layout ``(R, C) = (out, in)``.

Stacks, batch axes and the Flax ``(in, out)`` layout are the caller's business: slice
the stack and transpose a Flax kernel to ``(out, in)`` before calling ``muon_step``.
"""

from __future__ import annotations

import numpy as np

POLAR_EXPRESS_COEFFS = (
    (8.156554524902461, -22.48329292557795, 15.878769915207462),
    (4.042929935166739, -2.808917465908714, 0.5000178451051316),
    (3.8916678022926607, -2.772484153217685, 0.5060648178503393),
    (3.285753657755655, -2.3681294933425376, 0.46449024233003106),
    (2.3465413258596377, -1.7097828382687081, 0.42323551169305323),
)
QUINTIC = (3.4445, -4.7750, 2.0315)


def coefficients(ns_coeffs, ns_steps):
    """The rule's (a, b, c) per step for muon's ``ns_coeffs`` option (a name or numbers)."""
    if isinstance(ns_coeffs, str):
        ns_coeffs = {"polar_express": POLAR_EXPRESS_COEFFS, "quintic": QUINTIC}[ns_coeffs]
    table = np.asarray(ns_coeffs, dtype=np.float64)
    if table.ndim == 1:
        return [tuple(table)] * ns_steps
    if len(table) < ns_steps:
        raise ValueError("too few coefficients")
    return [tuple(row) for row in table[:ns_steps]]


def _f64(x) -> np.ndarray:
    return np.array(x, dtype=np.float64, copy=True)


def lerp(a, b, w):
    """``a + w * (b - a)``, the spec's lerp."""
    return a + w * (b - a)


# ----------------------------------------------------------------------------- AdamW


def adamw_step(p, g, m, v, t, *, lr, b1, b2, eps, weight_decay):
    """One AdamW step (spec §2). Returns ``(p_new, m_new, v_new)``, all float64.

    ``t`` is the step number of this step (the first step is ``t = 1``).
    """
    if t < 1:
        raise ValueError(f"t is 1-based, got {t}")
    p, g, m, v = _f64(p), _f64(g), _f64(m), _f64(v)
    p = p * (1.0 - lr * weight_decay)
    m = lerp(m, g, 1.0 - b1)
    v = lerp(v, g * g, 1.0 - b2)
    bias1 = 1.0 - b1**t
    bias2 = 1.0 - b2**t
    p = p - (lr / bias1) * m / (np.sqrt(v / bias2) + eps)
    return p, m, v


# ------------------------------------------------------------------------------ Muon


def init_muon_state(R: int, C: int):
    """Zero ``(momentum_buffer, second_momentum_buffer)`` for an ``(R, C)`` matrix."""
    buf = np.zeros((R, C), dtype=np.float64)
    s = np.zeros((R, 1) if R >= C else (1, C), dtype=np.float64)
    return buf, s


def row_equilibrate(X):
    """MuonEq (spec §3 step 3): rescale every row to norm ``fro_norm(X) / sqrt(R)``."""
    X = _f64(X)
    R = X.shape[0]
    target = np.linalg.norm(X) / np.sqrt(R)
    row = np.maximum(np.linalg.norm(X, axis=1, keepdims=True), 1e-6)
    return X * (target / row)


def polar_express(X, ns_steps: int, coeffs=None, preconditioning="basin"):
    """Spec §3 steps 4-5: basin scaling, then ``ns_steps`` Polar Express iterations.

    Returns an approximation of the orthogonal polar factor ``U V^T`` of ``X``
    (singular values pushed towards 1). Options (``muon``'s): ``coeffs``, one (a, b, c)
    per step instead of Polar Express's; ``preconditioning="aol"``: no basin scaling,
    the first step scales the rows of the short side's ``X`` (a square's input side,
    the columns here) by ``1 / sqrt(sum_j |A_ij|)``, ``A = X X^T``.
    """
    if coeffs is None:
        if not 0 <= ns_steps <= len(POLAR_EXPRESS_COEFFS):
            raise ValueError(f"ns_steps must be in [0, {len(POLAR_EXPRESS_COEFFS)}]")
        coeffs = POLAR_EXPRESS_COEFFS[:ns_steps]
    X = _f64(X)
    R, C = X.shape
    if preconditioning == "aol":
        Y = X.T if R >= C else X
        d = 1.0 / np.sqrt(np.maximum(np.abs(Y @ Y.T).sum(axis=1, keepdims=True), 1e-8))
        X = (d * Y).T if R >= C else d * Y
    else:
        X = X / (1.01 * np.linalg.norm(X) + 1e-6)
    for a, b, c in coeffs:
        if R > C:  # tall: work with the (C, C) Gram matrix
            A = X.T @ X
            B = b * A + c * (A @ A)
            X = a * X + X @ B
        else:  # wide or square: the (R, R) Gram matrix
            A = X @ X.T
            B = b * A + c * (A @ A)
            X = a * X + B @ X
    return X


def muon_step(
    G,
    P,
    buf,
    s,
    *,
    lr,
    momentum,
    beta2,
    weight_decay,
    ns_steps,
    row_equilibration=True,
    renormalize=True,
    coeffs=None,
    preconditioning="basin",
    nesterov=True,
    normuon=True,
    cautious=True,
):
    """One Muon step (spec §3) for ONE matrix in PyTorch layout.

    ``G``, ``P``, ``buf``: ``(R, C)`` with R = output features, C = input features.
    ``s``: ``(R, 1)`` if ``R >= C`` else ``(1, C)``.
    Returns ``(P_new, buf_new, s_new)``, all float64.

    ``muon``'s options beyond the spec: ``coeffs``/``preconditioning`` (see
    :func:`polar_express`); ``nesterov=False``: ``U = buf``; ``normuon=False``: skip
    step 7; ``cautious=False``: decay every entry.
    """
    G, P, buf, s = _f64(G), _f64(P), _f64(buf), _f64(s)
    if G.ndim != 2:
        raise ValueError(f"muon_step takes one 2-D matrix, got shape {G.shape}")
    R, C = G.shape
    if P.shape != (R, C) or buf.shape != (R, C):
        raise ValueError(f"shape mismatch: G {G.shape}, P {P.shape}, buf {buf.shape}")
    s_shape = (R, 1) if R >= C else (1, C)
    if s.shape != s_shape:
        raise ValueError(f"s must have shape {s_shape} for a {R}x{C} matrix, got {s.shape}")

    # 1. Nesterov momentum
    buf = lerp(buf, G, 1.0 - momentum)
    U = lerp(G, buf, momentum) if nesterov else buf

    # 2. (compute dtype: not simulated)
    X = U

    # 3. MuonEq row equilibration
    if row_equilibration:
        X = row_equilibrate(X)

    # 4.-5. basin scaling + Polar Express
    O = polar_express(X, ns_steps, coeffs, preconditioning)

    # 6. Muon+ renormalisation
    if renormalize:
        O = O * (np.sqrt(min(R, C)) / max(np.linalg.norm(O), 1e-6))

    # 7. NorMuon variance reduction; factored axis: columns if R >= C else rows
    if normuon:
        red = 1 if R >= C else 0
        n = O.shape[red]
        v = np.mean(O * O, axis=red, keepdims=True)
        v_norm = np.sqrt(np.sum(v) * n)
        s = lerp(s, v, 1.0 - beta2)
        step = 1.0 / np.sqrt(np.maximum(s, 1e-10))
        v_norm_new = np.sqrt(np.sum(v * n * step**2))
        O = O * step * (v_norm / max(v_norm_new, 1e-10))

    # 8. learning rate with the aspect-ratio factor
    lr_eff = lr * np.sqrt(max(1.0, R / C))

    # 9. cautious weight decay (mask from the old P) + update
    mask = (O * P) >= 0 if cautious else True
    P = P - lr_eff * O - lr_eff * weight_decay * P * mask
    return P, buf, s


# ------------------------------------------------------------------- whole param trees


OPTIONS = ("ns_coeffs", "preconditioning", "nesterov", "normuon", "cautious", "mu_dtype")


class ReferenceMuonAdamW:
    """The whole optimizer on a flat ``{path: array}`` dict, one matrix at a time.

    ``groups`` use the library's format (nanochat's, without ``params``); scalar
    hyperparameters may be callables of the 0-based step count. ``labels`` maps path to
    group. ``layouts`` maps a Muon path to ``(reduction_axes, output_axes)``; default
    ``((-2,), (-1,))``, the Flax ``(in, out)`` layout; other axes are batch axes. Each
    matrix is brought to PyTorch ``(out, in)`` layout, stepped with :func:`muon_step`
    and put back.
    """

    def __init__(self, groups, labels, layouts=None):
        self.groups, self.labels, self.layouts = groups, labels, layouts or {}
        self.count = 0
        self.state = {}

    def _value(self, x):
        return float(x(self.count)) if callable(x) else float(x)

    def _matrices(self, x, path):
        red, out = self.layouts.get(path, ((-2,), (-1,)))
        red = tuple(a % x.ndim for a in red)
        out = tuple(a % x.ndim for a in out)
        batch = tuple(a for a in range(x.ndim) if a not in red + out)
        perm = batch + out + red
        rows = int(np.prod([x.shape[a] for a in out]))
        cols = int(np.prod([x.shape[a] for a in red]))
        mats = np.transpose(x, perm).reshape(-1, rows, cols)

        def back(m):
            shaped = m.reshape(tuple(x.shape[a] for a in perm))
            return np.transpose(shaped, np.argsort(perm))

        return mats, back

    def step(self, params, grads):
        """Returns the new params (float64) after one step on ``grads``."""
        new = {}
        for path, p in params.items():
            g, hp = _f64(grads[path]), self.groups[self.labels[path]]
            v = {k: self._value(x) for k, x in hp.items()
                 if k not in ("kind", "ns_steps", "row_equilibration", "renormalize",
                              "compute_dtype", "polar_method", "betas") + OPTIONS}
            if hp["kind"] == "adamw":
                m, vv = self.state.get(path, (np.zeros_like(g), np.zeros_like(g)))
                b1, b2 = (self._value(b) for b in hp["betas"])
                new[path], m, vv = adamw_step(p, g, m, vv, self.count + 1, lr=v["lr"], b1=b1,
                                              b2=b2, eps=v["eps"],
                                              weight_decay=v["weight_decay"])
                self.state[path] = (m, vv)
                continue
            P, back = self._matrices(_f64(p), path)
            G, _ = self._matrices(g, path)
            states = self.state.get(path) or [init_muon_state(*P.shape[1:]) for _ in P]
            outs = []
            for i in range(len(P)):
                P_new, buf, s = muon_step(
                    G[i], P[i], *states[i], lr=v["lr"], momentum=v["momentum"],
                    beta2=v["beta2"], weight_decay=v["weight_decay"], ns_steps=hp["ns_steps"],
                    row_equilibration=hp.get("row_equilibration", True),
                    renormalize=hp.get("renormalize", True),
                    coeffs=coefficients(hp.get("ns_coeffs", "polar_express"), hp["ns_steps"]),
                    preconditioning=hp.get("preconditioning", "basin"),
                    nesterov=hp.get("nesterov", True), normuon=hp.get("normuon", True),
                    cautious=hp.get("cautious", True))
                outs.append(P_new)
                states[i] = (buf, s)
            self.state[path] = states
            new[path] = back(np.stack(outs))
        self.count += 1
        return new
