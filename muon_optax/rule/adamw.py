"""AdamW, as nanochat (and torch.optim.AdamW) computes it, for any slice of a parameter:

    p = p * (1 - lr * wd)                      decoupled weight decay, before the step
    m = lerp(m, g, 1 - b1);  v = lerp(v, g^2, 1 - b2)
    p = p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

Arithmetic in float32, moments stored in the parameter's dtype, the new parameter rounded
to it once (:func:`update_in_param_dtype`). ``optax.adamw`` computes the same."""

from __future__ import annotations

from typing import TYPE_CHECKING

import jax
import jax.numpy as jnp

if TYPE_CHECKING:  # the config imports the kernels, not the other way
    from muon_optax.rule.hparams import AdamWConfig


def update_in_param_dtype(p32: jax.Array, update32: jax.Array, dtype) -> jax.Array:
    """``P_new - P`` in the parameter dtype, such that ``P + update`` rounds only once:
    below float32, ``P_new`` is rounded here and the difference is exact whenever it is
    within a factor 2 of ``P`` (Sterbenz), where a bf16 update would round twice."""
    if jnp.finfo(dtype).bits >= 32:
        return update32.astype(dtype)
    p_new32 = (p32 + update32).astype(dtype).astype(jnp.float32)
    # where equal, 0: an inf parameter that stays inf gets 0, not inf - inf
    return jnp.where(p_new32 == p32, 0.0, p_new32 - p32).astype(dtype)


def adamw_leaf_update(g: jax.Array, p: jax.Array | None, m: jax.Array, v: jax.Array,
                      t: jax.Array, hp: dict[str, jax.Array], *, cfg: AdamWConfig | None = None
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One AdamW step on a parameter or a slice: ``(update, m, v)``. ``t``: the 1-based step;
    ``p`` None: no weight decay. optax's options: ``hp["eps_root"]`` under the root, and
    ``cfg``'s ``nesterov`` and ``optax_ema`` (its moments' rounding: ``b m`` in their dtype)."""
    f32, lr, b1, b2 = jnp.float32, hp["lr"], hp["b1"], hp["b2"]
    g32 = g.astype(f32)
    if cfg is not None and cfg.optax_ema:
        # 1 - b from the exact constant: float32's 1 - f32(b) is off by an ulp of b,
        # which flips bf16 roundings of m.
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
    if cfg is not None and cfg.nesterov:
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
