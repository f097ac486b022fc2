"""AdamW, as nanochat (and torch.optim.AdamW) computes it, for any slice of a parameter.

    p = p * (1 - lr * wd)                      decoupled weight decay, before the step
    m = lerp(m, g, 1 - b1);  v = lerp(v, g^2, 1 - b2)
    p = p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

All arithmetic is float32 whatever the parameter dtype; the moments are stored in the
parameter's dtype, and the new parameter is rounded to it once (see
:func:`update_in_param_dtype`). ``optax.adamw`` computes the same function.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # the config imports the kernels, not the other way
    from muon_optax.rule.hparams import AdamWConfig


def update_in_param_dtype(p32: jax.Array, update32: jax.Array, dtype) -> jax.Array:
    """``P_new - P`` in the parameter dtype, such that ``P + update`` rounds only once.

    The rule computes ``P_new`` in float32 and rounds it once to the parameter dtype. An
    update cast to bf16 and then added by ``optax.apply_updates`` is rounded twice
    (``u``, then ``P + u``): 0.2% to 5% of the elements of a bf16 step ended one ulp
    off. So below float32 the new parameter is rounded once here and the update is the
    difference of two numbers of that dtype, taken in float32: exact in the dtype
    whenever ``P_new`` is within a factor 2 of ``P`` (Sterbenz), so ``apply_updates``
    gives ``P_new`` back bit for bit. The update keeps the parameter's dtype (no float32
    copy of every update). float32 updates are returned as computed.
    """
    dtype = jnp.dtype(dtype)
    if jnp.finfo(dtype).bits >= 32:
        return update32.astype(dtype)
    p_new32 = (p32 + update32).astype(dtype).astype(jnp.float32)
    # where equal, 0: an inf parameter that stays inf gets 0, not inf - inf
    return jnp.where(p_new32 == p32, 0.0, p_new32 - p32).astype(dtype)


def adamw_hparams(cfg: AdamWConfig, count: jax.Array) -> dict[str, jax.Array]:
    """The group's hyperparameters at step ``count`` (before it is incremented)."""
    return cfg.at(count)


def adamw_leaf_update(
    g: jax.Array, p: jax.Array | None, m: jax.Array, v: jax.Array, t: jax.Array,
    hp: dict[str, jax.Array], *, cfg: AdamWConfig | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One AdamW step on a parameter (or a slice of one): ``(update, m, v)``.

    ``t`` is the 1-based step number. ``p`` may be None when weight decay is off. The
    update is ``p_new - p`` in the parameter's dtype; ``m`` and ``v`` keep their dtypes.

    optax's options: ``hp["eps_root"]`` (if present) goes under the root,
    ``sqrt(v_hat + eps_root)``; ``cfg.nesterov`` replaces ``m / (1 - b1^t)`` by
    Nesterov's look-ahead ``b1 m / (1 - b1^(t+1)) + (1 - b1) g / (1 - b1^t)``;
    ``cfg.optax_ema`` computes the moments as optax does, ``m = (1 - b1) g + b1 m``
    with the product ``b1 m`` in ``m``'s dtype (not float32 for a bfloat16 ``m``) and
    ``1 - b1`` from the exact constant (likewise ``v``).
    """
    f32 = jnp.float32
    lr, b1, b2 = hp["lr"], hp["b1"], hp["b2"]
    nesterov = cfg is not None and cfg.nesterov
    g32 = g.astype(f32)
    if cfg is not None and cfg.optax_ema:
        # 1 - b from the exact constant: float32's 1 - f32(b) is off by an ulp of b,
        # 1e-5 of 1 - b for b2 = 0.999, and flips bf16 roundings of m.
        c1, c2 = (1.0 - b if isinstance(b, float) else 1 - hp_b
                  for b, hp_b in ((cfg.b1, b1), (cfg.b2, b2)))
        m32 = c1 * g32 + (b1.astype(m.dtype) * m).astype(f32)
        v32 = c2 * (g32 * g32) + (b2.astype(v.dtype) * v).astype(f32)
    else:
        m32 = m.astype(f32) + (1 - b1) * (g32 - m.astype(f32))
        v32 = v.astype(f32) + (1 - b2) * (g32 * g32 - v.astype(f32))
    t = t.astype(f32)
    v_hat = v32 / (1 - b2**t)
    if "eps_root" in hp:
        v_hat = v_hat + hp["eps_root"]
    if nesterov:
        m_hat = b1 * m32 / (1 - b1 ** (t + 1)) + (1 - b1) * g32 / (1 - b1**t)
        step = lr * m_hat / (jnp.sqrt(v_hat) + hp["eps"])
    else:
        step = (lr / (1 - b1**t)) * m32 / (jnp.sqrt(v_hat) + hp["eps"])
    if p is None:
        update = (-step).astype(g.dtype)
    else:  # (p * (1 - lr wd) - step) - p, with the decay term kept exact for small lr*wd
        p32 = p.astype(f32)
        update = update_in_param_dtype(p32, -(lr * hp["weight_decay"]) * p32 - step, p.dtype)
    return update, m32.astype(m.dtype), v32.astype(v.dtype)
