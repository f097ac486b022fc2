"""Muon: Nesterov momentum, Polar Express, NorMuon and cautious weight decay.

One step for a stack of K matrices ``(K, R, C)``, stored wide or square (``R <= C``,
see :mod:`muon_optax.layout`), every operation per matrix:

    buf = lerp(buf, G, 1 - momentum);  U = lerp(G, buf, momentum)        Nesterov
    X   = U * (||U||_F / sqrt(rows)) / max(row_norms(U), 1e-6)           MuonEq (optional)
    X   = PolarExpress(X / (1.01 ||X||_F + 1e-6))                        orthogonalize
    O   = X * sqrt(min(R, C)) / max(||X||_F, 1e-6)                       Muon+ (optional)
    v   = mean(O^2, axis=red);  s = lerp(s, v, 1 - beta2)                NorMuon
    O   = O * rsqrt(s) * (||v||-preserving factor)
    P   = P - lr_eff O - lr_eff wd P [O P >= 0]                           cautious decay

``rows`` and ``red`` refer to the matrix's own orientation (PyTorch ``(out, in)``); a
matrix stored transposed equilibrates its stored columns instead. ``lr_eff`` is
``lr * sqrt(max(1, R / C))``. References: Keller Jordan's Muon (2024); Polar Express,
arXiv:2505.16932; NorMuon, arXiv:2510.05491; nanochat's ``optim.py``.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from muon_optax.adamw import update_in_param_dtype
from muon_optax.hparams import MuonConfig
from muon_optax.polar import default_compute_dtype, polar_express_stack


class MuonStackState(NamedTuple):
    """Muon state of one stack, in the stored ``(K, R, C)`` layout (parameter dtype)."""

    momentum: jax.Array          # (K, R, C)
    second_moment: jax.Array     # NorMuon: (K, 1, C) if it averages stored rows, else (K, R, 1)


def normuon_axis(rows: int, cols: int, transposed: bool | jax.Array) -> int:
    """The stored axis NorMuon averages over.

    The rule averages a matrix's own columns if ``R >= C``, else its rows. Stored
    wide, that is the stored rows in both orientations (a wide matrix's rows; a tall
    one's columns, stored transposed); a square averages its columns, which are the
    stored rows when it is stored transposed. Square stacks never mix layouts.
    """
    return -2 if rows < cols or transposed is True else -1


def init_stack_state(k: int, rows: int, cols: int, dtype: Any,
                     reduces_rows: bool) -> MuonStackState:
    second = (k, 1, cols) if reduces_rows else (k, rows, 1)
    return MuonStackState(jnp.zeros((k, rows, cols), dtype), jnp.zeros(second, dtype))


def muon_hparams(cfg: MuonConfig, count: jax.Array) -> dict[str, jax.Array]:
    """The group's hyperparameters at step ``count`` (before it is incremented)."""
    return cfg.at(count)


def _input_scale(x: jax.Array, transposed: bool | jax.Array,
                 row_equilibration: bool) -> jax.Array:
    """MuonEq and the basin scaling as one factor per own row, from one pass of norms.

    MuonEq scales each of the matrix's own rows to the RMS row norm
    ``||X||_F / sqrt(rows)``; the polar iteration then needs ``X / (1.01 ||X||_F +
    1e-6)``. The Frobenius norm after equilibration follows from the row norms, so both
    scalings are one multiply of ``X``. Norms in float32.
    """
    x32 = x.astype(jnp.float32)

    def factor(axis: int) -> jax.Array:  # axis summed over: -1 makes stored rows own rows
        sq = jnp.sum(x32 * x32, axis=axis, keepdims=True)
        fro2 = jnp.sum(sq, axis=(-2, -1), keepdims=True)
        if not row_equilibration:
            return 1 / (1.01 * jnp.sqrt(fro2) + 1e-6)
        own_rows = x.shape[-2] if axis == -1 else x.shape[-1]
        eq = jnp.sqrt(fro2 / own_rows) / jnp.maximum(jnp.sqrt(sq), 1e-6)
        fro_eq = jnp.sqrt(jnp.sum(sq * eq * eq, axis=(-2, -1), keepdims=True))
        return eq / (1.01 * fro_eq + 1e-6)

    if not row_equilibration or transposed is False:
        return factor(-1)
    if transposed is True:
        return factor(-2)
    # a stack mixing both orientations: pick per matrix
    return jnp.where(transposed[:, None, None], factor(-2), factor(-1))


def momentum_update(g: jax.Array, buf: jax.Array, momentum: jax.Array) -> jax.Array:
    """Step 1a: ``buf = lerp(buf, G, 1 - momentum)``, stored in the buffer's dtype."""
    f32 = jnp.float32
    g32, buf32 = g.astype(f32), buf.astype(f32)
    return (buf32 + (1 - momentum) * (g32 - buf32)).astype(buf.dtype)


def nesterov_input(g: jax.Array, buf: jax.Array, momentum: jax.Array) -> jax.Array:
    """Step 1b: ``U = lerp(G, buf, momentum)`` in float32, from the stored new buffer
    (as nanochat reads it back after its in-place update)."""
    g32 = g.astype(jnp.float32)
    return g32 + momentum * (buf.astype(jnp.float32) - g32)


def normalized_direction(
    u: jax.Array,
    second_moment: jax.Array,
    *,
    beta2: jax.Array,
    transposed: bool | jax.Array,
    cfg: MuonConfig,
    dtype: Any,
) -> tuple[jax.Array, jax.Array]:
    """Steps 2-7 on a stored stack ``U`` (float32): the direction ``O`` (in ``dtype``, the
    parameter dtype) and the new NorMuon second moment.

    Every scaling of the rule (MuonEq, the basin, Muon+, NorMuon) is a factor per row or
    column, so each side of the polar iteration is one pass of statistics and one
    multiply.
    """
    f32 = jnp.float32
    rows, cols = u.shape[-2:]
    compute_dtype = cfg.compute_dtype or default_compute_dtype()
    x = u.astype(compute_dtype)
    x = (x.astype(f32) * _input_scale(x, transposed, cfg.row_equilibration))
    o = polar_express_stack(x.astype(compute_dtype), cfg.ns_steps, cfg.polar_method)
    o = o.astype(dtype).astype(f32)  # the rule rounds O to the parameter dtype here

    # NorMuon: a factored second moment of O along the reduced axis, then rescale so that
    # the matrix's overall norm is kept. Muon+ (O * sqrt(min(R, C)) / ||O||_F) scales
    # those statistics by r^2, ||O||_F^2 being n * sum(v).
    red = normuon_axis(rows, cols, transposed)
    n = o.shape[red]
    v = jnp.mean(o * o, axis=red, keepdims=True)
    r = 1.0
    if cfg.renormalize:
        fro = jnp.sqrt(jnp.sum(v, axis=(-2, -1), keepdims=True) * n)
        r = jnp.sqrt(float(min(rows, cols))) / jnp.maximum(fro, 1e-6)
        v = v * (r * r)
    v_norm = jnp.sqrt(jnp.sum(v, axis=(-2, -1), keepdims=True) * n)
    s = second_moment.astype(f32)
    s = (s + (1 - beta2) * (v - s)).astype(second_moment.dtype)
    step = jax.lax.rsqrt(jnp.maximum(s.astype(f32), 1e-10))
    v_norm_new = jnp.sqrt(jnp.sum(v * n * step * step, axis=(-2, -1), keepdims=True))
    o = o * (r * step * (v_norm / jnp.maximum(v_norm_new, 1e-10)))
    return o.astype(dtype), s


def muon_direction(
    g: jax.Array,
    state: MuonStackState,
    *,
    momentum: jax.Array,
    beta2: jax.Array,
    transposed: bool | jax.Array,
    cfg: MuonConfig,
) -> tuple[jax.Array, MuonStackState]:
    """Steps 1-7 of Muon on a stored stack: the direction ``O`` and the new state.

    ``g`` is ``(K, R, C)`` with ``R <= C``, in the parameter dtype, which ``O`` and the
    state keep. ``momentum`` and ``beta2`` are scalars or per-matrix ``(K, 1, 1)``
    arrays. ``transposed`` says whether a matrix's own rows are the stored columns (a
    bool for the whole stack, or a ``(K,)`` array). Zero padding stays exactly zero.
    (The engine runs the two halves itself, to write the momentum back early.)
    """
    buf = momentum_update(g, state.momentum, momentum)
    u = nesterov_input(g, buf, momentum)
    o, s = normalized_direction(u, state.second_moment, beta2=beta2, transposed=transposed,
                                cfg=cfg, dtype=state.momentum.dtype)
    return o, MuonStackState(buf, s)


def cautious_update(o: jax.Array, p: jax.Array, lr: jax.Array,
                    weight_decay: jax.Array) -> jax.Array:
    """Step 9: ``P_new - P = -lr O - lr wd P [O P >= 0]``, in the parameter's dtype.

    Weight decay acts only where the update and the weight agree in sign. ``lr``
    includes the aspect-ratio factor. Float32 arithmetic; ``P_new`` is rounded once to
    the parameter dtype (:func:`muon_optax.adamw.update_in_param_dtype`). Elementwise,
    so it runs on each leaf in its own layout, after the stacked directions are split
    back.
    """
    o32, p32 = o.astype(jnp.float32), p.astype(jnp.float32)
    update = -lr * o32 - (lr * weight_decay) * jnp.where(o32 * p32 >= 0, p32, 0.0)
    return update_in_param_dtype(p32, update, p.dtype)
