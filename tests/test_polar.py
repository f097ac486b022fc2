"""Polar Express forms against a float64 run of the rule's own iteration."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from muon_optax import orthogonalize
from muon_optax.rule.coefficients import POLAR_EXPRESS_COEFFS, QUINTIC_COEFFS, ns_coefficients
from muon_optax.rule.order import after, wait_for
from muon_optax.rule.polar import (
    choose_method,
    polar_express,
    polar_express_stack,
    polar_flops,
    polar_iteration,
    preconditioned_step,
)


def exact(x):
    """The rule's iteration in float64 (wide or square x)."""
    x = np.asarray(x, np.float64)
    for a, b, c in POLAR_EXPRESS_COEFFS:
        g = x @ x.T
        x = a * x + (b * g + c * g @ g) @ x
    return x


def conditioned(rows, cols, log10_cond, seed=0):
    rng = np.random.default_rng(seed)
    u, _, vt = np.linalg.svd(rng.standard_normal((rows, cols)), full_matrices=False)
    x = (u * np.logspace(0, -log10_cond, min(rows, cols))) @ vt
    return x / (1.01 * np.linalg.norm(x))


def rel_err(got, want):
    return np.linalg.norm(np.asarray(got, np.float64) - want) / np.linalg.norm(want)


@pytest.mark.parametrize("log10_cond", [1, 4, 6])
@pytest.mark.parametrize("shape", [(64, 256), (96, 288)])
def test_gram_form_is_as_accurate_as_direct(shape, log10_cond):
    x = conditioned(*shape, log10_cond)
    want = exact(x)
    direct = rel_err(polar_express(jnp.asarray(x, jnp.float32), 5, "direct"), want)
    gram = rel_err(polar_express(jnp.asarray(x, jnp.float32), 5, "gram"), want)
    assert direct < 5e-5
    # Two direct steps before the Gram space keep the small singular values resolved.
    assert gram < max(3 * direct, 1e-5), (gram, direct)


def test_gram_form_of_tall_is_transpose_of_wide():
    x = jnp.asarray(conditioned(48, 160, 2), jnp.float32)
    np.testing.assert_allclose(polar_express(x.T, 5, "gram"), polar_express(x, 5, "gram").T,
                               rtol=0, atol=1e-6)


def test_auto_uses_gram_only_where_it_saves_flops_in_float32():
    assert choose_method(256, 1024, 5, "auto") == "gram"
    assert choose_method(1024, 256, 5, "auto") == "gram"
    assert choose_method(256, 256, 5, "auto") == "direct"
    assert choose_method(256, 1024, 5, "auto", jnp.bfloat16) == "direct"
    assert choose_method(256, 1024, 3, "auto") == "direct"   # too few steps to gain
    assert polar_flops(256, 1024, 5, "direct") / polar_flops(256, 1024, 5, "gram") > 1.25
    with pytest.raises(ValueError, match="polar method"):
        choose_method(4, 8, 5, "fast")


def test_stack_form_matches_batched_form():
    x = jnp.asarray(np.stack([conditioned(32, 96, 2, seed=s) for s in range(4)]), jnp.float32)
    for method in ("direct", "gram"):
        np.testing.assert_allclose(polar_express_stack(x, 5, method),
                                   polar_express(x, 5, method), rtol=0, atol=2e-6)


@pytest.mark.parametrize("prev", [2.0, -3.0, 0.0, -0.0, np.inf, -np.inf, np.nan])
def test_after_returns_x_bit_for_bit(prev):
    # (No subnormals: XLA:CPU flushes them to zero in any arithmetic.)
    x = jnp.array([0.0, -0.0, 1.5, -2.5, np.inf, -np.inf, np.nan, 1e-30], jnp.float32)
    got = np.asarray(after(x, jnp.full((2, 3), prev, jnp.float32)))
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(x).view(np.uint32))


@pytest.mark.parametrize("form", [None, "tpu"])
def test_wait_for_returns_its_inputs_bit_for_bit(form, monkeypatch):
    """Both forms of :func:`wait_for`: the arithmetic (XLA:CPU's) and the TPU's
    optimization barrier, which keeps subnormals too."""
    from muon_optax.rule import platform

    if form:
        monkeypatch.setitem(platform.FORCED, "order", form)
    x = jnp.array([0.0, -0.0, 1.5, -2.5, np.inf, -np.inf, np.nan, 1e-30]
                  + ([1e-40] if form else []), jnp.float32)
    xs = {"f32": x, "bf16": x.astype(jnp.bfloat16)}
    fn = jax.jit(lambda xs, a, b: wait_for(xs, a, None, b))
    args = (xs, jnp.full((2, 3), np.nan, jnp.float32), jnp.ones(4, jnp.bfloat16))
    got = fn(*args)
    for key, view in (("f32", np.uint32), ("bf16", np.uint16)):
        np.testing.assert_array_equal(np.asarray(got[key]).view(view),
                                      np.asarray(xs[key]).view(view))
    assert ("stablehlo.optimization_barrier" in fn.lower(*args).as_text()) == bool(form)
    assert wait_for(xs, None) is xs


def exact_any(x):
    """:func:`exact` for a wide, square or tall matrix."""
    x = np.asarray(x, np.float64)
    return exact(x) if x.shape[0] <= x.shape[1] else exact(x.T).T


@pytest.mark.parametrize("method,bound", [("direct", 0.03), ("gram", 0.045)])
@pytest.mark.parametrize("shape", [(64, 256), (96, 32), (64, 64)])
def test_bf16_stack_is_close_to_the_float64_iteration(shape, method, bound):
    # The batched (K, R, C) bf16 program that GPUs and TPUs run by default, here on CPU.
    # With the coefficients rounded to bf16 (8.1875 for 8.1566, ...) the error was
    # 0.057 to 0.080 (direct) and 0.061 to 0.080 (gram); the polynomial formed in float32
    # and rounded once gives 0.014 to 0.020 (direct) and 0.016 to 0.038 (gram).
    x = jnp.asarray(np.stack([conditioned(*shape, c, seed=c) for c in (1, 2)]), jnp.bfloat16)
    got = polar_express(x, 5, method)
    assert got.dtype == jnp.bfloat16
    for i in range(x.shape[0]):
        err = rel_err(got[i], exact_any(x[i]))
        assert err < bound, (i, err)


@pytest.mark.parametrize("method", ["direct", "gram"])
def test_bf16_program_has_no_bf16_coefficients(method):
    # A Python float times a bf16 array becomes a bf16 literal in the program.
    x = jnp.zeros((2, 16, 48), jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: polar_express(x, 5, method))(x))
    assert not re.search(r":bf16\[\]", jaxpr), re.findall(r"\S+:bf16\[\]", jaxpr)
    # The coefficients enter as a float32 table, read one row per step of the loop.
    assert re.search(r"f32\[[25],3\]", jaxpr), jaxpr


def test_orthogonalize_scales_in_float32_then_rounds_once():
    x = jnp.asarray(conditioned(32, 64, 1) * 7.3, jnp.bfloat16)
    jaxpr = str(jax.make_jaxpr(lambda x: orthogonalize(x, compute_dtype=jnp.bfloat16))(x))
    assert not re.search(r":bf16\[\]", jaxpr)
    got = orthogonalize(x, compute_dtype=jnp.bfloat16)
    x64 = np.asarray(x, np.float64)
    assert rel_err(got, exact(x64 / (1.01 * np.linalg.norm(x64)))) < 0.03
# ----------------------------------------------------- coefficients and preconditionings


@pytest.mark.parametrize("preconditioning", ["frobenius", "spectral", "aol", "schatten"])
@pytest.mark.parametrize("coeffs", ["quintic", "dion"])
@pytest.mark.parametrize("shape", [(16, 48), (48, 16), (32, 32)])
def test_preconditionings_match_optax(shape, coeffs, preconditioning):
    from optax.contrib._muon import orthogonalize_via_newton_schulz

    from muon_optax.rule.coefficients import DION_COEFFS

    table = {"quintic": QUINTIC_COEFFS[0], "dion": DION_COEFFS}[coeffs]
    x = jnp.asarray(np.random.default_rng(1).standard_normal(shape), jnp.float32)
    want = orthogonalize_via_newton_schulz(x, jnp.asarray(table), 5, preconditioning)
    got = orthogonalize(x, 5, compute_dtype=jnp.float32, ns_coeffs=table,
                        preconditioning=preconditioning)
    assert rel_err(got, np.asarray(want, np.float64)) < 1e-5


@pytest.mark.parametrize("preconditioning", ["aol", "schatten", "frobenius", "spectral"])
def test_preconditionings_keep_zero_zero(preconditioning):
    o = orthogonalize(jnp.zeros((2, 8, 24)), 3, compute_dtype=jnp.float32,
                      ns_coeffs="quintic", preconditioning=preconditioning)
    np.testing.assert_array_equal(o, 0.0)


def test_aol_first_step_bounds_the_spectral_norm():
    # The AOL scaling alone (identity polynomial): ||D X||_2 <= 1, and tighter than the
    # Frobenius scaling for a matrix with a flat spectrum.
    x = jnp.asarray(np.random.default_rng(2).standard_normal((32, 128)), jnp.float32)
    scaled = preconditioned_step(x, (1.0, 0.0, 0.0), "aol")
    top = np.linalg.norm(np.asarray(scaled, np.float64), 2)
    assert 0.5 < top <= 1.0 + 1e-6
    assert top > np.linalg.norm(np.asarray(x), 2) / np.linalg.norm(np.asarray(x))


def test_ns_coefficients_presets_triples_and_tables():
    assert ns_coefficients("polar_express", 3) == POLAR_EXPRESS_COEFFS[:3]
    assert ns_coefficients("quintic", 7) == QUINTIC_COEFFS * 7
    assert ns_coefficients((1, 2, 3), 2) == ((1.0, 2.0, 3.0),) * 2
    assert ns_coefficients(np.ones((4, 3)), 3) == ((1.0, 1.0, 1.0),) * 3
    with pytest.raises(ValueError, match=r"unknown ns_coeffs preset 'polar_expres' "
                                         r"\(did you mean 'polar_express'\?\)"):
        ns_coefficients("polar_expres", 5)
    with pytest.raises(ValueError, match=r"triple \(a, b, c\) \(shape \(3,\)\) or an \(n, 3\)"
                                         r" table, one row per iteration; got shape \(2,\)"):
        ns_coefficients((1, 2), 5)
    with pytest.raises(ValueError, match=r"has 2 rows, too few for ns_steps=5"):
        ns_coefficients(np.ones((2, 3)), 5)
    with pytest.raises(ValueError, match="non-finite"):
        ns_coefficients((1, np.nan, 2), 5)
    with pytest.raises(ValueError, match=r"ns_steps=6 is outside 1\.\.5"):
        ns_coefficients("polar_express", 6)


def test_unknown_preconditioning_is_named():
    with pytest.raises(ValueError, match=r"unknown preconditioning 'aoll' \(did you mean "
                                         r"'aol'\?\)"):
        orthogonalize(jnp.ones((4, 8)), preconditioning="aoll")


def test_stack_with_coefficients_matches_batched_iteration():
    x = jnp.asarray(np.stack([conditioned(32, 96, 2, seed=s) for s in range(4)]), jnp.float32)
    coeffs = QUINTIC_COEFFS * 5
    for pre in ("basin", "aol"):
        np.testing.assert_allclose(
            polar_express_stack(x, 5, "direct", coeffs=coeffs, preconditioning=pre),
            polar_iteration(x, coeffs, "direct", preconditioning=pre), rtol=0, atol=2e-6)
