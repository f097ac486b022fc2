"""AdamW, as nanochat (and torch.optim.AdamW) computes it, for any slice of a parameter:

    p = p * (1 - lr * wd)                      decoupled weight decay, before the step
    m = lerp(m, g, 1 - b1);  v = lerp(v, g^2, 1 - b2)
    p = p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

Arithmetic in float32, moments stored in the parameter's dtype, the new parameter rounded
to it once (:func:`update_in_param_dtype`). ``optax.adamw`` computes the same."""

from __future__ import annotations

import jax
import jax.numpy as jnp


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
                      t: jax.Array, hp: dict[str, jax.Array]
                      ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One AdamW step on a parameter or a slice: ``(update, m, v)``. ``t``: the 1-based step;
    ``p`` None: no weight decay."""
    f32, b1, b2 = jnp.float32, hp["b1"], hp["b2"]
    g32 = g.astype(f32)
    m32 = m.astype(f32) + (1 - b1) * (g32 - m.astype(f32))
    v32 = v.astype(f32) + (1 - b2) * (g32 * g32 - v.astype(f32))
    t = t.astype(f32)
    v_hat = v32 / (1 - b2**t)
    step = (hp["lr"] / (1 - b1**t)) * m32 / (jnp.sqrt(v_hat) + hp["eps"])
    return decayed(step, g, p, hp), m32.astype(m.dtype), v32.astype(v.dtype)


def decayed(step: jax.Array, g: jax.Array, p: jax.Array | None, hp: dict[str, jax.Array]
            ) -> jax.Array:
    """The update ``-step - lr wd p`` in the parameter's dtype (``p`` None: ``-step``)."""
    if p is None:
        return (-step).astype(g.dtype)
    # (p * (1 - lr wd) - step) - p, with the decay term kept exact for small lr*wd
    p32 = p.astype(jnp.float32)
    return update_in_param_dtype(p32, -(hp["lr"] * hp["weight_decay"]) * p32 - step, p.dtype)
