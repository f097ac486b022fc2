"""optax.contrib.muon's and torch.optim.Muon's rule (the maths: :func:`muon_optax.contrib_muon`,
:func:`muon_optax.torch_muon`) on :mod:`muon_optax.rule.muon`'s polar iteration."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any, ClassVar

import jax
import jax.numpy as jnp

from muon_optax.rule import hparams, muon
from muon_optax.rule.adamw import decayed, update_in_param_dtype
from muon_optax.rule.coefficients import Coeffs, ns_coefficients
from muon_optax.rule.order import after


def optax_ema(x32: jax.Array, old: jax.Array, b: hparams.Scalar, b_now: jax.Array) -> jax.Array:
    """optax's moment ``(1 - b) x + b old`` in float32, ``b old`` rounded to ``old``'s dtype
    first; ``1 - b`` from the exact constant where ``b`` is one (float32's ``1 - f32(b)`` is
    off by an ulp of ``b``, which flips bf16 roundings). ``b_now``: ``b``'s value this step."""
    c = 1.0 - b if isinstance(b, float) else 1 - b_now
    return c * x32 + (b_now.astype(old.dtype) * old).astype(jnp.float32)


@dataclasses.dataclass(frozen=True)
class ContribConfig:
    """A Muon group of optax.contrib.muon's (``adam``: its bias-corrected first moment,
    :func:`optax_ema`, ``U`` unrounded) or torch.optim.Muon's rule
    (torch's lerps). ``adaptive``: ``O <U, O>``, ``<U, O>`` summed over the leaf."""

    lr: hparams.Scalar
    momentum: hparams.Scalar
    weight_decay: hparams.Scalar
    coeffs: Coeffs
    preconditioning: str = "frobenius"
    eps: float = 1e-8
    nesterov: bool = True
    compute_dtype: Any = None
    mu_dtype: Any = None
    adam: bool = True
    adaptive: bool = False
    consistent_rms: float | None = None
    # nanochat's options the engine and the polar iteration read, fixed here
    row_equilibration: ClassVar[bool] = False
    normuon: ClassVar[bool] = False
    polar_method: ClassVar[str] = "direct"
    # the values a schedule or inject_hyperparams may set; every other field is static
    _VALUES: ClassVar[tuple[str, ...]] = ("lr", "momentum", "weight_decay")

    @classmethod
    def make(cls, lr, momentum, weight_decay, coeffs, *, preconditioning="frobenius",
             eps=1e-8, nesterov=True, compute_dtype=None, mu_dtype=None, adam=True,
             adaptive=False, consistent_rms=None, where="contrib_muon") -> ContribConfig:
        scalars = (hparams.check_scalar(v, n, where) for v, n in (
            (lr, "lr"), (momentum, "momentum"), (weight_decay, "weight_decay")))
        flags = {n: hparams.check_flag(v, n, where) for n, v in (
            ("nesterov", nesterov), ("adam", adam), ("adaptive", adaptive))}
        # preconditioning: contrib_muon checks it against its own list (torch_muon's default)
        return cls(*scalars, ns_coefficients(coeffs, len(coeffs), where), preconditioning,
                   hparams.static_float(eps, "eps", where), **flags,
                   compute_dtype=hparams.check_dtype(compute_dtype, "compute_dtype", where),
                   mu_dtype=hparams.check_dtype(mu_dtype, "mu_dtype", where),
                   consistent_rms=None if consistent_rms is None
                   else hparams.static_float(consistent_rms, "consistent_rms", where))

    ns_steps = property(lambda self: len(self.coeffs))
    leaf_scaled = property(lambda self: self.adaptive)  # the engine sums <U, O> per leaf

    def at(self, count: jax.Array) -> dict[str, jax.Array]:
        return {k: hparams.value_at(getattr(self, k), count) for k in self._VALUES}

    def static_key(self) -> tuple:
        return tuple(getattr(self, f.name) for f in dataclasses.fields(self)
                     if f.name not in self._VALUES) + (self.complement(),)

    def complement(self) -> float | None:
        """``1 - mu`` from the exact (Python) constant for ``adam``; None otherwise."""
        return 1.0 - self.momentum if self.adam and isinstance(self.momentum, float) else None

    def lr_scale(self, rows: int, cols: int) -> float:
        """The lr factor of a ``rows x cols`` matrix: nanochat's, or ``c sqrt(max(R, C))``
        for ``consistent_rms = c``, an update RMS of about ``c`` (arXiv:2502.16982)."""
        if self.consistent_rms is None:
            return muon.matrix_lr_scale(rows, cols)
        return math.sqrt(max(rows, cols)) * self.consistent_rms

    def step(self, g: jax.Array, state: muon.MuonStackState, hp: Mapping[str, Any],
             count: jax.Array, dtype: Any, *, order: bool = True
             ) -> tuple[jax.Array, muon.MuonStackState, jax.Array | None]:
        """:func:`muon_optax.rule.muon.muon_step`'s contract (the second moment kept as
        is), with ``adaptive`` the per-matrix ``<U, O>``. ``count``: steps before."""
        f32, mu, layout = jnp.float32, hp["momentum"], state.momentum.shape
        g32 = g.astype(f32)
        if not self.adam:
            stored, u = muon.momentum(g32, state.momentum, mu, nesterov=self.nesterov)
        else:
            c = self.complement()
            buf32 = optax_ema(muon.in_layout(g32, g.shape, layout), state.momentum,
                              self.momentum, muon.in_layout(mu, g.shape, layout))
            stored = buf32.astype(state.momentum.dtype)
            buf = (stored if stored.dtype == f32 else buf32).reshape(g.shape).astype(f32)
            t = count.astype(f32) + 1
            u = (mu * buf / (1 - mu ** (t + 1)) + (1 - mu if c is None else c) * g32
                 / (1 - mu**t) if self.nesterov else buf / (1 - mu**t))
        o = muon.orthogonalized(u, hp["transposed"], self, dtype)
        # <U, O> is U's nuclear norm for its exact polar factor O: O <U, O> is steepest
        # descent under the spectral norm (arXiv:2409.20325)
        d = jnp.sum(u * o.astype(f32), axis=(-2, -1), keepdims=True) if self.adaptive else None
        return o, muon.MuonStackState(after(stored, u if order else None), state.second_moment), d

    def leaf_update(self, o: jax.Array, p: jax.Array, lr: jax.Array, weight_decay: jax.Array,
                    *, rows: int, cols: int) -> jax.Array:
        """``P_new - P = -lr s O - lr wd P`` in the parameter's dtype (``s``: :meth:`lr_scale`)."""
        o32, p32 = o.astype(jnp.float32), p.astype(jnp.float32)
        lr_o = lr * self.lr_scale(rows, cols)
        return update_in_param_dtype(p32, -lr_o * o32 - (lr * weight_decay) * p32, p.dtype)


@dataclasses.dataclass(frozen=True)
class OptaxAdamConfig(hparams.AdamWConfig):
    """optax.adamw's rule (contrib_muon's Adam): nanochat's AdamW but for optax's options and
    its moments' rounding (``b m`` rounded to the moment's dtype before the sum):

        m = (1 - b1) g + b1 m;  v = (1 - b2) g^2 + b2 v;  v_hat = v / (1 - b2^t) + eps_root
        m_hat = b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)   (nesterov)  or  m / (1 - b1^t)
        update = -lr m_hat / (sqrt(v_hat) + eps) - lr wd p"""

    eps_root: hparams.Scalar = 0.0
    nesterov: bool = True
    mu_dtype: Any = None

    @classmethod
    def make(cls, lr, betas, eps, weight_decay, where="contrib_muon (its Adam)", *,
             eps_root=0.0, nesterov=True, mu_dtype=None) -> OptaxAdamConfig:
        base = vars(hparams.AdamWConfig.make(lr, betas, eps, weight_decay, where))
        return cls(**base, eps_root=hparams.check_scalar(eps_root, "eps_root", where),
                   nesterov=hparams.check_flag(nesterov, "nesterov", where),
                   mu_dtype=hparams.check_dtype(mu_dtype, "mu_dtype", where))

    def at(self, count: jax.Array) -> dict[str, jax.Array]:
        """As nanochat's, with ``eps_root`` when it is not the constant 0."""
        zero = isinstance(self.eps_root, float) and self.eps_root == 0.0
        return super().at(count) | ({} if zero else {"eps_root": hparams.value_at(
            self.eps_root, count)})

    def step(self, g: jax.Array, p: jax.Array | None, m: jax.Array, v: jax.Array,
             t: jax.Array, hp: dict[str, jax.Array]) -> tuple[jax.Array, jax.Array, jax.Array]:
        """:func:`~muon_optax.rule.adamw.adamw_leaf_update`'s contract."""
        f32, b1, b2 = jnp.float32, hp["b1"], hp["b2"]
        g32 = g.astype(f32)
        m32, v32 = optax_ema(g32, m, self.b1, b1), optax_ema(g32 * g32, v, self.b2, b2)
        t = t.astype(f32)
        v_hat = v32 / (1 - b2**t)
        v_hat = v_hat + hp["eps_root"] if "eps_root" in hp else v_hat
        lr_m = (hp["lr"] * (b1 * m32 / (1 - b1 ** (t + 1)) + (1 - b1) * g32 / (1 - b1**t))
                if self.nesterov else (hp["lr"] / (1 - b1**t)) * m32)
        step = lr_m / (jnp.sqrt(v_hat) + hp["eps"])
        return decayed(step, g, p, hp), m32.astype(m.dtype), v32.astype(v.dtype)
