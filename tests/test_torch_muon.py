"""torch_muon against torch.optim.Muon (where torch is installed), and on the engine.

torch runs its Newton-Schulz iteration in bfloat16; the float32 reference swaps in a
float32 iteration of the same quintic (written here), so the rest of torch's step
(momentum, decay, learning-rate adjustment) is torch's own code.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

import muon_optax

TOL = 1e-4
SHAPES = {"tall": (48, 16), "wide": (16, 40), "square": (24, 24)}


def tree(seed, shapes=SHAPES, scale=1.0):
    keys = jax.random.split(jax.random.PRNGKey(seed), len(shapes))
    return {k: scale * jax.random.normal(key, shapes[k]) for key, k in zip(keys, sorted(shapes))}


def grads(step, shapes=SHAPES):
    return tree(100 + step, shapes)


def float32_newton_schulz(torch):
    def orthogonalize(g, coefficients, steps, eps):
        a, b, c = coefficients
        flip = g.shape[0] > g.shape[1]
        x = g.float().T if flip else g.float()
        x = x / torch.clamp(torch.linalg.matrix_norm(x), min=eps)
        for _ in range(steps):
            gram = x @ x.T
            x = a * x + (b * gram + c * gram @ gram) @ x
        return x.T if flip else x
    return orthogonalize


def shapes_of(params):
    return {k: tuple(v.shape) for k, v in params.items()}


def run_torch(params, n, kw, *, float32, lr_at=None, grads_of=None):
    """torch.optim.Muon's params after ``n`` steps on ``grads_of(0..n-1)`` (default
    ``grads``); ``lr_at(t)``: the lr of step ``t``, set on the group before it (as a
    scheduler does)."""
    torch = pytest.importorskip("torch")
    from torch.optim import _muon

    ps = {k: torch.nn.Parameter(torch.tensor(np.asarray(v))) for k, v in params.items()}
    opt = torch.optim.Muon(list(ps.values()), **kw)
    original = _muon._zeropower_via_newtonschulz
    if float32:
        _muon._zeropower_via_newtonschulz = float32_newton_schulz(torch)
    try:
        for t in range(n):
            g = grads_of(t) if grads_of else grads(t, shapes_of(params))
            for k, p in ps.items():
                p.grad = torch.tensor(np.asarray(g[k]))
            if lr_at is not None:
                opt.param_groups[0]["lr"] = float(lr_at(t))
            opt.step()
    finally:
        _muon._zeropower_via_newtonschulz = original
    return {k: p.detach().numpy() for k, p in ps.items()}


def run_ours(tx, params, n, put=lambda t: t, step=None):
    state = tx.init(params)
    step = step or jax.jit(tx.update)
    for t in range(n):
        updates, state = step(put(grads(t, shapes_of(params))), state, params)
        params = optax.apply_updates(params, updates)
    return {k: np.asarray(v) for k, v in params.items()}


def relative(got, want, start):
    return {k: float(np.linalg.norm(got[k] - want[k])
                     / np.linalg.norm(want[k] - np.asarray(start[k]))) for k in want}


CASES = {
    "defaults": dict(lr=0.02),
    "match_rms_adamw": dict(lr=0.02, adjust_lr_fn="match_rms_adamw"),
    "original_no_nesterov_options": dict(
        lr=0.05, weight_decay=0.02, momentum=0.9, nesterov=False, eps=1e-6, ns_steps=3,
        ns_coefficients=(3.0, -3.2, 1.2), adjust_lr_fn="original"),
}


@pytest.mark.parametrize("name", list(CASES))
def test_equals_torch_with_a_float32_iteration(name):
    kw = CASES[name]
    p0 = tree(0, scale=0.5)
    want = run_torch(p0, 5, kw, float32=True)
    got = run_ours(muon_optax.torch_muon(**kw, compute_dtype=jnp.float32), p0, 5)
    errors = relative(got, want, p0)
    assert max(errors.values()) <= TOL, errors


def test_a_schedule_is_torchs_lr_set_per_step():
    schedule = optax.linear_schedule(0.05, 0.01, 5)
    p0 = tree(0, scale=0.5)
    want = run_torch(p0, 5, dict(lr=0.05), float32=True, lr_at=schedule)
    got = run_ours(muon_optax.torch_muon(lr=schedule, compute_dtype=jnp.float32), p0, 5)
    errors = relative(got, want, p0)
    assert max(errors.values()) <= TOL, errors


@pytest.mark.parametrize("compute_dtype, factor", [(jnp.float32, 1.05), (jnp.bfloat16, 2.5)])
def test_within_torchs_own_bfloat16_gap(compute_dtype, factor):
    """Against the real torch.optim.Muon (bfloat16 iteration), measured against torch's
    own gap (torch with a float32 iteration): that gap is 0.8-1.0% of the change on CPU.
    Ours in float32 is as far as torch in float32. Ours in bfloat16 (rounded differently
    from torch's bfloat16): 1.24-1.31% on CPU (1.35x the gap); on an H200, 0.9-1.5%
    against a gap of 0.65-0.77% (2.0x), hence 2.5x."""
    p0 = tree(0, scale=0.5)
    real = run_torch(p0, 5, dict(lr=0.02), float32=False)
    exact = run_torch(p0, 5, dict(lr=0.02), float32=True)
    got = run_ours(muon_optax.torch_muon(lr=0.02, compute_dtype=compute_dtype), p0, 5)
    gap, ours = relative(exact, real, p0), relative(got, real, p0)
    for k in SHAPES:
        assert ours[k] <= factor * gap[k], (k, ours[k], gap[k])


def test_blocks_and_batch_axes_are_torchs_matrices():
    """A fused (3 d, d) weight cut in 3 output blocks and a scanned (L, out, in) stack step
    as torch.optim.Muon steps each piece on its own."""
    d = 16
    D = muon_optax.MuonDimensionNumbers
    p0 = tree(0, {"qkv": (3 * d, d), "layers": (2, d, 2 * d)}, scale=0.5)
    tx = muon_optax.torch_muon(lr=0.02, compute_dtype=jnp.float32, dimension_numbers={
        "qkv": D(reduction_axis=1, output_axis=0, output_blocks=3),
        "layers": D(reduction_axis=2, output_axis=1)})
    got = run_ours(tx, p0, 3)

    def cut(x):
        out = {f"qkv{i}": x["qkv"][i * d:(i + 1) * d] for i in range(3)}
        return out | {f"layers{i}": x["layers"][i] for i in range(2)}

    want = run_torch(cut(p0), 3, dict(lr=0.02), float32=True,
                     grads_of=lambda t: cut(grads(t, shapes_of(p0))))
    for i in range(3):
        np.testing.assert_allclose(got["qkv"][i * d:(i + 1) * d], want[f"qkv{i}"], atol=1e-5)
    for i in range(2):
        np.testing.assert_allclose(got["layers"][i], want[f"layers{i}"], atol=1e-5)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("mode", ["fsdp", "zero2"])
def test_sharded_equals_one_device(mode):
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    n = 8
    shapes = {**SHAPES, "more": (48, 16), "stack": (3, 16, 24)}
    p0 = tree(0, shapes, scale=0.5)
    want = run_ours(muon_optax.torch_muon(lr=0.02, compute_dtype=jnp.float32), p0, 3)
    if mode == "fsdp":
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
        tx = muon_optax.torch_muon(lr=0.02, compute_dtype=jnp.float32, axis_name="data",
                                   mesh=mesh)
        spec = lambda x: P("data") if x.shape[0] % n == 0 else P()  # noqa: E731
        put = lambda t: {k: jax.device_put(x, NamedSharding(mesh, spec(x)))  # noqa: E731
                         for k, x in t.items()}
        got = run_ours(tx, put(p0), 3, put)
    else:
        mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Auto,))
        tx = muon_optax.torch_muon(lr=0.02, compute_dtype=jnp.float32, axis_name="data")
        specs = muon_optax.state_specs(tx, p0, mesh)
        step = jax.jit(jax.shard_map(
            lambda g, s, p: tx.update(jax.tree.map(lambda x: x[0], g), s, p), mesh=mesh,
            in_specs=(P("data"), specs, P()), out_specs=(P(), specs)))
        sharded = optax.GradientTransformation(
            lambda p: jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                                            out_specs=specs))(p), None)
        put = lambda t: jax.tree.map(lambda x: jnp.broadcast_to(x, (n,) + x.shape), t)  # noqa
        got = run_ours(sharded, p0, 3, put, step)
    errors = relative(got, want, p0)
    assert max(errors.values()) <= 1e-5, errors
    est = muon_optax.estimate(tx, p0, n)
    assert len(est["state_bytes"]) == n and sum(est["state_bytes"]) >= 4 * sum(
        x.size for x in jax.tree.leaves(p0))


@pytest.mark.parametrize("kw, exc, msg", [
    (dict(adjust_lr_fn="moonlight"), ValueError, "adjust_lr_fn='moonlight'; use None or"),
    (dict(lr=-0.1), ValueError, "lr=-0.1; it must be >= 0"),
    (dict(weight_decay=-1.0), ValueError, "weight_decay=-1.0; it must be >= 0"),
    (dict(ns_coefficients=(3.0, -3.0)), ValueError, "ns_coefficients must be three numbers"),
    (dict(ns_steps=100), ValueError, "ns_steps=100; use 1..99"),
    (dict(ns_steps=2.0), TypeError, "ns_steps must be an int"),
])
def test_bad_arguments_fail_at_construction(kw, exc, msg):
    with pytest.raises(exc, match=msg):
        muon_optax.torch_muon(**kw)


def test_a_vector_is_named_with_the_fix():
    tx = muon_optax.torch_muon()
    with pytest.raises(ValueError, match="parameter 'b' has shape .16,.; torch.optim.Muon "
                                         "takes matrices only.*optax.partition"):
        tx.init({"w": jnp.ones((16, 16)), "b": jnp.ones(16)})
