"""AdamW's leaf math (muon_optax/rule/adamw.py): bf16 parameters rounded once (optax's Adam,
with its options, is tested in test_contrib.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from muon_optax.rule.adamw import adamw_leaf_update, update_in_param_dtype

try:
    from . import reference as ref
except ImportError:  # plain `pytest` rootdir imports
    import reference as ref

HP = dict(b1=0.9, b2=0.95, eps=1e-8, weight_decay=0.1)
N = 1 << 14


def to64(x):
    return np.asarray(jnp.asarray(x).astype(jnp.float32), np.float64)


def rounded_once(x64, dtype=jnp.bfloat16):
    """The rule's float result rounded once to the parameter dtype."""
    return to64(jnp.asarray(np.asarray(x64, np.float32)).astype(dtype))


def assert_rounded_once(p, new, want):
    """``new`` is ``want`` wherever the new parameter is within a factor 2 of the old.

    There the update, a difference of two bf16 numbers, is exact in bf16 (Sterbenz),
    so apply_updates must land on the single rounding. Elsewhere no bf16 update can
    always do so (the update's own ulp is coarser than the new parameter's).
    """
    p = to64(p)
    near = np.abs(want - p) <= np.abs(p) / 2
    assert near.mean() > 0.9
    off = (new != want) & near
    assert off.mean() < 1e-4, f"{off.mean():.3%} of elements off the single rounding"


@pytest.mark.parametrize("p_std,lr,t", [(0.02, 1e-3, 10), (0.5, 1e-2, 1)])
def test_bf16_params_are_rounded_once(p_std, lr, t):
    # Before: the update was rounded to bf16 and P + u again by apply_updates, leaving
    # 2.3% (p_std 0.02) and 2.4% (p_std 0.5) of these elements one ulp off.
    keys = jax.random.split(jax.random.PRNGKey(t), 4)
    p = (p_std * jax.random.normal(keys[0], (N,))).astype(jnp.bfloat16)
    g = jax.random.normal(keys[1], (N,)).astype(jnp.bfloat16)
    m = (0.1 * jax.random.normal(keys[2], (N,))).astype(jnp.bfloat16)
    v = (0.1 * jax.random.uniform(keys[3], (N,))).astype(jnp.bfloat16)
    hp = {k: jnp.float32(x) for k, x in (HP | {"lr": lr}).items()}
    u, m_new, v_new = jax.jit(adamw_leaf_update)(g, p, m, v, jnp.int32(t), hp)
    assert u.dtype == m_new.dtype == v_new.dtype == jnp.bfloat16
    want = rounded_once(ref.adamw_step(to64(p), to64(g), to64(m), to64(v), t, lr=lr, **HP)[0])
    assert_rounded_once(p, to64(optax.apply_updates(p, u)), want)


def test_update_in_param_dtype_keeps_inf_and_float32():
    p = jnp.array([np.inf, -np.inf, 0.0, 1.0], jnp.bfloat16)
    u = update_in_param_dtype(p.astype(jnp.float32), jnp.full(4, -0.25, jnp.float32), p.dtype)
    np.testing.assert_array_equal(optax.apply_updates(p, u).astype(jnp.float32),
                                  [np.inf, -np.inf, -0.25, 0.75])
    u32 = jnp.array([1e-9, -3.0], jnp.float32)
    np.testing.assert_array_equal(update_in_param_dtype(jnp.ones(2), u32, jnp.float32), u32)
