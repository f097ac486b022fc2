"""adamw.py with optax's Adam options (eps_root, Nesterov, mu_dtype) against optax.adamw."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from muon_optax.adamw import adamw_hparams, adamw_leaf_update
from muon_optax.hparams import AdamWConfig


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("eps_root", [0.0, 1e-6])
@pytest.mark.parametrize("mu_dtype", [None, jnp.bfloat16])
def test_leaf_update_matches_optax_adamw(nesterov, eps_root, mu_dtype):
    lr = optax.linear_schedule(0.01, 0.002, 10)
    kw = dict(b1=0.9, b2=0.999, eps=1e-8, eps_root=eps_root, weight_decay=0.1,
              mu_dtype=mu_dtype, nesterov=nesterov)
    tx = optax.adamw(lr, **kw)
    cfg = AdamWConfig.make(lr, (0.9, 0.999), 1e-8, 0.1, eps_root=eps_root, nesterov=nesterov,
                           mu_dtype=mu_dtype, optax_ema=True)
    keys = jax.random.split(jax.random.PRNGKey(0), 11)
    p = jax.random.normal(keys[0], (6, 5))
    state = tx.init(p)
    m = jnp.zeros_like(p, dtype=mu_dtype or p.dtype)
    v = jnp.zeros_like(p)
    for step in range(10):
        g = jax.random.normal(keys[step + 1], p.shape)
        want, state = tx.update(g, state, p)
        hp = adamw_hparams(cfg, jnp.int32(step))
        got, m, v = adamw_leaf_update(g, p, m, v, jnp.int32(step + 1), hp, cfg=cfg)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
        np.testing.assert_array_equal(m, state[0].mu)
        np.testing.assert_allclose(v, state[0].nu, rtol=1e-6)
        p = p + got


def test_eps_root_is_left_out_when_zero():
    assert "eps_root" not in adamw_hparams(AdamWConfig.make(0.1, (0.9, 0.99), 1e-8, 0.0), 0)
    assert "eps_root" in adamw_hparams(
        AdamWConfig.make(0.1, (0.9, 0.99), 1e-8, 0.0, eps_root=1e-9), 0)
