"""Muon: Nesterov momentum, Polar Express, NorMuon and cautious weight decay, one step for a
stack ``(K, R, C)`` as stored (:mod:`muon_optax.params.layout`), every operation per matrix:

    buf = lerp(buf, G, 1 - momentum);  U = lerp(G, buf, momentum)        Nesterov
    X   = U * (||U||_F / sqrt(rows)) / max(row_norms(U), 1e-6)           MuonEq (optional)
    X   = PolarExpress(X / (1.01 ||X||_F + 1e-6))                        orthogonalize
    O   = X * sqrt(min(R, C)) / max(||X||_F, 1e-6)                       Muon+ (optional)
    v   = mean(O^2, axis=red);  s = lerp(s, v, 1 - beta2)                NorMuon
    O   = O * rsqrt(s) * (||v||-preserving factor)
    P   = P - lr_eff O - lr_eff wd P [O P >= 0]                           cautious decay

``rows``, ``red``: the matrix's own (PyTorch ``(out, in)``); ``lr_eff = lr * sqrt(max(1, R / C))``.
References: Keller Jordan's Muon (2024); NorMuon, arXiv:2510.05491; nanochat's ``optim.py``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, NamedTuple

import jax
import jax.numpy as jnp

from muon_optax.rule.adamw import update_in_param_dtype
from muon_optax.rule.order import after
from muon_optax.rule.platform import per_platform
from muon_optax.rule.polar import overflow_scale, polar_express_stack, precondition

if TYPE_CHECKING:  # the config imports the kernel, not the other way
    from muon_optax.rule.hparams import MuonConfig


class MuonStackState(NamedTuple):
    """Muon state of one stack, in the stored ``(K, R, C)`` layout (parameter dtype)."""

    momentum: jax.Array          # (K, R, C)
    second_moment: jax.Array     # NorMuon: (K, 1, C) if it averages stored rows, else (K, R, 1)


def normuon_axis(rows: int, cols: int, transposed: bool | jax.Array) -> int:
    """The stored axis NorMuon averages over: a wide matrix's own rows, a tall or square
    one's own columns (stacks mixing orientations are never square)."""
    return -2 if rows < cols or (rows == cols and transposed is True) else -1


def _input_scale(x: jax.Array, transposed: bool | jax.Array,
                 row_equilibration: bool, basin: bool) -> jax.Array:
    """MuonEq and the basin scaling as one factor per own row (``basin=False``: MuonEq
    alone), from one pass of float32 norms of ``x * s`` (finite; the basin takes ``s`` back)."""
    s = overflow_scale(x.astype(jnp.float32))
    x32 = x.astype(jnp.float32) * s
    def factor(axis: int) -> jax.Array:  # axis summed over: -1 makes stored rows own rows
        sq = jnp.sum(x32 * x32, axis=axis, keepdims=True)
        fro2 = jnp.sum(sq, axis=(-2, -1), keepdims=True)
        if not row_equilibration:
            return s / (1.01 * jnp.sqrt(fro2) + 1e-6)
        own_rows = x.shape[-2] if axis == -1 else x.shape[-1]
        eq = jnp.sqrt(fro2 / own_rows) / jnp.maximum(jnp.sqrt(sq), 1e-6)
        if not basin:
            return eq
        fro_eq = jnp.sqrt(jnp.sum(sq * eq * eq, axis=(-2, -1), keepdims=True))
        return s * eq / (1.01 * fro_eq + 1e-6)
    if not row_equilibration or transposed is False:
        return factor(-1)
    if transposed is True:
        return factor(-2)
    return jnp.where(transposed[:, None, None], factor(-2), factor(-1))  # mixed orientations


def in_layout(x: jax.Array, shape: tuple, layout: tuple) -> jax.Array:
    """``x`` (of ``shape``, or a factor broadcast to it) in the momentum buffer's ``layout``."""
    return x if jnp.ndim(x) == 0 or layout == shape else jnp.broadcast_to(x, shape).reshape(layout)


def momentum(g32: jax.Array, buf: jax.Array, mu: jax.Array, *,
             nesterov: bool = True) -> tuple[jax.Array, jax.Array]:
    """The new buffer in ``buf``'s dtype and layout, and ``U`` in float32 from the stored
    buffer, as nanochat reads it back after its in-place update."""
    shape, layout = g32.shape, buf.shape
    g_l, c = in_layout(g32, shape, layout), 1 - in_layout(mu, shape, layout)
    old = buf.astype(jnp.float32)
    stored = (old + c * (g_l - old)).astype(buf.dtype)
    new = stored.reshape(shape).astype(jnp.float32)
    return stored, g32 + mu * (new - g32) if nesterov else new


def _orthogonalized(u: jax.Array, transposed: bool | jax.Array, cfg: MuonConfig,
                    compute_dtype: Any) -> jax.Array:
    """MuonEq, the preconditioning and the polar iteration of ``U``."""
    f32, (rows, cols) = jnp.float32, u.shape[-2:]
    x = u.astype(compute_dtype)
    basin = cfg.preconditioning == "basin"
    if basin or cfg.row_equilibration:
        x = x.astype(f32) * _input_scale(x, transposed, cfg.row_equilibration, basin)
    if not basin:
        x = precondition(x.astype(compute_dtype), cfg.preconditioning, cfg.eps)
    x = x.astype(compute_dtype)
    # AOL scales the Gram side's rows, so it is not transpose-equivariant: a square runs
    # it on its input side (as optax does), the stored columns when stored (out, in).
    on_cols = cfg.preconditioning == "aol" and rows == cols and transposed is False
    if on_cols:
        x = jnp.swapaxes(x, -1, -2)
    o = polar_express_stack(x, cfg.ns_steps, cfg.polar_method, coeffs=cfg.coeffs,
                            preconditioning=cfg.preconditioning)
    return jnp.swapaxes(o, -1, -2) if on_cols else o


def orthogonalized(u: jax.Array, transposed: bool | jax.Array, cfg: MuonConfig,
                   dtype: Any) -> jax.Array:
    """:func:`_orthogonalized` in ``cfg.compute_dtype`` (None: per platform), in ``dtype``."""
    if cfg.compute_dtype is not None:
        return _orthogonalized(u, transposed, cfg, cfg.compute_dtype).astype(dtype)
    return per_platform(
        "polar", u, cpu=lambda u: _orthogonalized(u, transposed, cfg, jnp.float32).astype(dtype),
        default=lambda u: _orthogonalized(u, transposed, cfg, jnp.bfloat16).astype(dtype))


def muon_step(cfg: MuonConfig, g: jax.Array, state: MuonStackState, hp: Mapping[str, Any],
              count: jax.Array, dtype: Any, *, order: bool = True
              ) -> tuple[jax.Array, MuonStackState, None]:
    """The rule up to NorMuon on a stored stack ``g`` ``(K, R, C)``: ``(O in dtype, state,
    None)``. The momentum, in any layout of ``g``'s size, comes back once ``U`` is computed,
    to overwrite the old in place (``order=False``: the caller orders it)."""
    f32, (rows, cols), transposed = jnp.float32, g.shape[-2:], hp["transposed"]
    stored, u = momentum(g.astype(f32), state.momentum, hp["momentum"], nesterov=cfg.nesterov)
    wait = u if order else None
    o = orthogonalized(u, transposed, cfg, dtype).astype(f32)
    if not cfg.normuon:
        if cfg.renormalize:  # Muon+ alone
            fro = jnp.sqrt(jnp.sum(o * o, axis=(-2, -1), keepdims=True))
            o = o * (jnp.sqrt(float(min(rows, cols))) / jnp.maximum(fro, 1e-6))
        return o.astype(dtype), MuonStackState(after(stored, wait), state.second_moment), None

    # NorMuon: a factored second moment of O along the reduced axis, then a rescale that
    # keeps the matrix's norm. Muon+ scales the statistics by r^2 (||O||_F^2 = n sum(v)).
    red = normuon_axis(rows, cols, transposed)
    n = o.shape[red]
    v = jnp.mean(o * o, axis=red, keepdims=True)
    r = 1.0
    if cfg.renormalize:
        fro = jnp.sqrt(jnp.sum(v, axis=(-2, -1), keepdims=True) * n)
        r = jnp.sqrt(float(min(rows, cols))) / jnp.maximum(fro, 1e-6)
        v = v * (r * r)
    v_norm = jnp.sqrt(jnp.sum(v, axis=(-2, -1), keepdims=True) * n)
    s = state.second_moment.astype(f32)
    s = (s + (1 - hp["beta2"]) * (v - s)).astype(state.second_moment.dtype)
    step = jax.lax.rsqrt(jnp.maximum(s.astype(f32), 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v * n * step * step, axis=(-2, -1), keepdims=True))
    o = o * (r * step * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    return o.astype(dtype), MuonStackState(after(stored, wait), s), None


def matrix_lr_scale(rows: int, cols: int) -> float:
    """The learning rate's factor for a ``rows x cols`` (out x in) matrix."""
    return math.sqrt(max(1.0, rows / cols))


def cautious_update(o: jax.Array, p: jax.Array, lr: jax.Array, weight_decay: jax.Array,
                    cautious: bool = True) -> jax.Array:
    """``P_new - P = -lr O - lr wd P [O P >= 0]`` in the parameter's dtype, elementwise (any
    layout): decay only where update and weight agree in sign (``cautious=False``: everywhere)."""
    o32, p32 = o.astype(jnp.float32), p.astype(jnp.float32)
    update = -lr * o32 - (lr * weight_decay) * (
        jnp.where(o32 * p32 >= 0, p32, 0.0) if cautious else p32)
    return update_in_param_dtype(p32, update, p.dtype)


def leaf_update(cfg: MuonConfig, o: jax.Array, p: jax.Array, lr: jax.Array,
                weight_decay: jax.Array, *, rows: int, cols: int) -> jax.Array:
    """One leaf's update: :func:`cautious_update` at ``lr_eff``."""
    return cautious_update(o, p, lr * matrix_lr_scale(rows, cols), weight_decay, cfg.cautious)
