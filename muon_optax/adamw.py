"""AdamW, as nanochat (and torch.optim.AdamW) computes it, for any slice of a parameter.

    p = p * (1 - lr * wd)                      decoupled weight decay, before the step
    m = lerp(m, g, 1 - b1);  v = lerp(v, g^2, 1 - b2)
    p = p - lr / (1 - b1^t) * m / (sqrt(v / (1 - b2^t)) + eps)

All arithmetic is float32 whatever the parameter dtype; the moments are stored in the
parameter's dtype. ``optax.adamw`` computes the same function.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from muon_optax.hparams import AdamWConfig


def adamw_hparams(cfg: AdamWConfig, count: jax.Array) -> dict[str, jax.Array]:
    """The group's hyperparameters at step ``count`` (before it is incremented)."""
    return cfg.at(count)


def adamw_leaf_update(
    g: jax.Array, p: jax.Array | None, m: jax.Array, v: jax.Array, t: jax.Array,
    hp: dict[str, jax.Array],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """One AdamW step on a parameter (or a slice of one): ``(update, m, v)``.

    ``t`` is the 1-based step number. ``p`` may be None when weight decay is off. The
    update is ``p_new - p`` in the parameter's dtype.
    """
    f32 = jnp.float32
    lr, b1, b2 = hp["lr"], hp["b1"], hp["b2"]
    g32 = g.astype(f32)
    m32 = m.astype(f32) + (1 - b1) * (g32 - m.astype(f32))
    v32 = v.astype(f32) + (1 - b2) * (g32 * g32 - v.astype(f32))
    t = t.astype(f32)
    step = (lr / (1 - b1**t)) * m32 / (jnp.sqrt(v32 / (1 - b2**t)) + hp["eps"])
    if p is None:
        update = -step
    else:  # (p * (1 - lr wd) - step) - p, with the decay term kept exact for small lr*wd
        update = -(lr * hp["weight_decay"]) * p.astype(f32) - step
    dtype = g.dtype if p is None else p.dtype
    return update.astype(dtype), m32.astype(m.dtype), v32.astype(v.dtype)
