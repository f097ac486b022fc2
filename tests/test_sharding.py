"""ZeRO-2 (``axis_name``) against the single-device optimizer, on 8 simulated CPU devices.

The sharded step on N devices, each with its own gradient, must equal the
single-device step on the mean gradient up to float reduction order (spec §5).
tests/conftest.py asks XLA for 8 host devices before jax is imported.
"""

import math
import re
from collections import Counter

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:  # plain `pytest` rootdir imports (tests/ is on sys.path)
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")

STEPS = 5
BF16 = jnp.bfloat16


# ----------------------------------------------------------------------------- helpers


sharded = sp.sharded
single_update = sp.single_update


def to_np(tree):
    return jax.tree.map(np.asarray, tree)


def flat(tree):
    return {muon_optax.path_str(p): x for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]}


def assert_changes_close(before, got, want, dtype, rtol):
    """Like tests/test_optimizer.py: the relative error of each leaf's change, plus half
    an ulp of the parameter (storing the new parameter rounds it to its dtype)."""
    eps = float(jnp.finfo(dtype).eps)
    for k, p0 in flat(before).items():
        p0 = np.asarray(p0, np.float64)
        d_got = np.asarray(flat(got)[k], np.float64) - p0
        d_want = np.asarray(flat(want)[k], np.float64) - p0
        err = np.linalg.norm(d_got - d_want)
        allowed = rtol * np.linalg.norm(d_want) + 0.5 * eps * np.linalg.norm(p0)
        rel = err / max(np.linalg.norm(d_want), 1e-30)
        assert err <= allowed, f"{k}: relative error {rel:.2e} > {rtol}"


def run_sharded(step, params, state, steps, n, dtype, first=0):
    for s in range(first, first + steps):
        params, state = step(params, state, sp.device_grads(s, range(n), dtype))
    return params, state


# ------------------------------------------------------------------ parity with 1 device


def check_parity(mesh_shape, names, dtype, rtol, state_rtol):
    mesh, init, step, specs, _ = sharded(mesh_shape, names, dtype)
    n = mesh.shape["data"]
    params = sp.make_params(dtype)
    state = init(params)
    tx1 = sp.make_tx(None)
    state1 = tx1.init(params)
    update1 = single_update(dtype)
    for s in range(STEPS):
        grads = sp.device_grads(s, range(n), dtype)
        new, state = step(params, state, grads)
        # The single-device step starts from the same (sharded run's) params every step,
        # so the comparison measures one step's error, not a drift.
        u, state1 = update1(sp.mean_grads(grads, dtype), state1, params)
        want = optax.apply_updates(params, u)
        new = to_np(new)
        assert_changes_close(params, new, want, dtype, rtol)
        if dtype == BF16 and n & (n - 1) == 0:
            # The mean of coarse gradients over 2^k devices is exact, so the updates may
            # differ only by rounding flips of the update and of the sum, elementwise.
            for k, w in flat(want).items():
                w, g = np.asarray(w, np.float64), np.asarray(flat(new)[k], np.float64)
                p0 = np.asarray(flat(params)[k], np.float64)
                ulps = np.abs(g - p0) + np.abs(w - p0) + np.maximum(np.abs(g), np.abs(w))
                assert np.all(np.abs(g - w) <= float(jnp.finfo(dtype).eps) * ulps), \
                    f"step {s}, {k}"
        params = new

    # The state, per parameter (export_state), is the single-device state.
    got = muon_optax.export_state(sp.make_tx("data"), state, params)
    want = muon_optax.export_state(tx1, state1, params)
    assert int(got["count"]) == int(want["count"]) == STEPS
    for name in ("mu", "nu", "momentum", "second_moment"):
        g, w = flat(to_np(got[name])), flat(to_np(want[name]))
        assert g.keys() == w.keys(), name
        for k in w:
            w64, g64 = w[k].astype(np.float64), g[k].astype(np.float64)
            np.testing.assert_allclose(g64, w64, rtol=state_rtol,
                                       atol=state_rtol * np.abs(w64).max(),
                                       err_msg=f"{name}/{k}")
    # The flat buffers' padding (devices that own less than the longest share) stays 0.
    for bufs in state.muon:
        for buf in bufs:
            assert np.isfinite(np.asarray(buf)).all()


@pytest.mark.parametrize("n", [1, 2, 3, 4, 8])
def test_sharded_matches_single_device_on_mean_grads(n):
    check_parity((n,), ("data",), np.float32, rtol=1e-5, state_rtol=1e-5)


@pytest.mark.parametrize("n", [3, 4])
def test_sharded_bf16_matches_single_device(n):
    # bf16 params, gradients and state. The gradients are coarse so that their sum is
    # exact (see sharded_problem.device_grads); at N=4 the mean is exact too and what is
    # left are last-bit differences of float32 arithmetic (bitwise equal here, on CPU).
    # At N=3 the mean is rounded: XLA keeps the sharded mean in float32 (excess
    # precision) where the reference rounds it to bf16, and Muon amplifies a 2^-8 change
    # of the gradient by ~40x, so only the norm-wise check with the half-ulp slack holds.
    check_parity((n,), ("data",), BF16, rtol=1e-2, state_rtol=2e-2)


@pytest.mark.parametrize("mesh_shape", [(4, 1), (2, 4)])
def test_mesh_with_more_axes_shards_over_data(mesh_shape):
    # Sharded over "data" only: with model > 1 each "model" group of devices sees the
    # same gradients and holds the same state shares (replicated along "model").
    mesh = sharded(mesh_shape, ("data", "model")).mesh
    assert tuple(mesh.shape.values()) == mesh_shape
    check_parity(mesh_shape, ("data", "model"), np.float32, rtol=1e-5, state_rtol=1e-5)


def test_problem_exercises_uneven_sharding():
    # Guards what the parity tests cover: stacks whose matrices devices own in unequal
    # numbers (conditional slots), split and replicated AdamW params.
    tx = sp.make_tx("data")
    params = sp.make_params()
    for n in (3, 4, 8):
        info = tx.init.stack_info(params, n)
        assert sorted(s["size"] for s in info) == [3, 5]
        assert any(len(set(s["counts"])) > 1 for s in info), n
    specs = muon_optax.state_specs(tx, params, sp.make_mesh((8,)))
    assert specs.mu["bias"] == P() and specs.mu["gain"] == P()
    assert specs.mu["embed"] != P() and specs.mu["head"] != P()


# ------------------------------------------------------------------ collectives in HLO


def _collective_sizes(hlo, op):
    """Element counts of every array an ``op`` instruction produces (tuples expanded)."""
    sizes = []
    pattern = re.compile(r"^\s*(?:ROOT\s+)?%?\S+\s*=\s*(.+?)\s+" + op + r"(?:-start)?\(")
    for line in hlo.splitlines():
        m = pattern.match(line)
        if m:
            for dims in re.findall(r"\b[a-z]+\d*\[([\d,]*)\]", m.group(1)):
                sizes.append(math.prod(int(d) for d in dims.split(",") if d))
    return sizes


@pytest.mark.parametrize("n", [3, 8])
def test_compiled_step_uses_reduce_scatter_and_all_gather(n):
    mesh, init, step, specs, hlo = sharded((n,))
    params = sp.make_params()

    # What each collective must move: padded AdamW params split along one axis, and
    # the Muon gradients of every device's owned matrices as one flat (N, L) buffer
    # (the same shape as the momentum buffer: the global state shapes carry the padding).
    glob = jax.eval_shape(init, params)
    big = [glob.mu[k].shape for k in ("embed", "head")]
    big += [bufs.momentum.shape for bufs in glob.muon]
    assert all(math.prod(s) % n == 0 for s in big)
    scattered = _collective_sizes(hlo, "reduce-scatter")
    gathered = _collective_sizes(hlo, "all-gather")
    reduced = _collective_sizes(hlo, "all-reduce")
    for s in big:
        assert math.prod(s) // n in scattered, (s, scattered)
        assert math.prod(s) in gathered, (s, gathered)
    # All-reduces carry only the small params' gradients (each at most once; XLA may
    # combine them into one tuple all-reduce).
    small = Counter(math.prod(sp.SHAPES[k]) for k in sp.SMALL)
    assert all(size < 1024 for size in reduced), reduced
    assert not Counter(reduced) - small, (reduced, small)
    # And nothing else: the bytes moved are one all-reduce's worth (RS + AG).
    assert sum(scattered) * n == sum(math.prod(s) for s in big)
    assert sum(gathered) == sum(math.prod(s) for s in big)


# ------------------------------------------------------------------ per-device memory


def _nbytes(x):
    return math.prod(x.shape) * jnp.dtype(x.dtype).itemsize


def per_device_state_bytes(n):
    params, labels, groups = sp.nanochat_like()
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    mesh = sp.make_mesh((n,))
    specs = muon_optax.state_specs(tx, params, mesh)
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), params)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(zeros)
    per_device = [0] * n
    for x in jax.tree.leaves(state):
        for shard in x.addressable_shards:
            per_device[mesh.devices.tolist().index(shard.device)] += shard.data.nbytes
    return per_device


def test_per_device_state_is_a_1_over_n_share():
    params, labels, groups = sp.nanochat_like()
    single = sum(_nbytes(x) for x in jax.tree.leaves(
        jax.eval_shape(muon_optax.muon_adamw(groups, labels).init, params)))
    small = 4 + sum(2 * _nbytes(params[k]) for k in ("resid_lambdas", "x0_lambdas",
                                                     "logit_scale"))   # count + mu, nu
    measured = {}
    for n in (1, 2, 4, 8):
        per_device = per_device_state_bytes(n)
        assert len(set(per_device)) == 1, per_device      # balanced
        measured[n] = per_device[0]
        assert measured[n] <= 1.1 * single / n + small, (n, measured[n], single)
    assert measured[1] == single
    print(f"single-device state {single} B; per-device: {measured}")


# ------------------------------------------------------------------ checkpointing


def abstract_state(state_shapes, specs, mesh):
    return jax.tree.map(
        lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                             sharding=NamedSharding(mesh, spec)),
        specs, state_shapes, is_leaf=lambda x: isinstance(x, P))


def test_checkpoint_restore_continues_bitwise(tmp_path):
    """Save params and sharded state with orbax after 2 steps at N=4, restore onto the
    sharded target, continue 3 steps: bitwise the uninterrupted run. Then restore onto
    a ("data", "model") mesh and, re-padded, onto N=8, and continue within tolerance."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh, init, step, specs, _ = sharded((4,))
    params = sp.make_params()
    state = init(params)
    params, state = run_sharded(step, params, state, 2, 4, np.float32)

    ckptr = ocp.StandardCheckpointer()
    path = tmp_path / "ckpt"
    ckptr.save(path, {"params": params, "opt_state": state})
    ckptr.wait_until_finished()

    want_params, want_state = run_sharded(step, params, state, 3, 4, np.float32, first=2)

    target = {"params": jax.tree.map(
                  lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                 sharding=NamedSharding(mesh, P())), params),
              "opt_state": abstract_state(jax.eval_shape(init, params), specs, mesh)}
    restored = ckptr.restore(path, target)
    ckptr.close()
    for got, want in zip(jax.tree.leaves(restored["opt_state"]), jax.tree.leaves(state)):
        assert got.sharding.is_equivalent_to(want.sharding, got.ndim)
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
    assert jax.tree.structure(restored["opt_state"]) == jax.tree.structure(state)

    got_params, got_state = run_sharded(step, restored["params"], restored["opt_state"], 3, 4,
                                        np.float32, first=2)
    for got, want in zip(jax.tree.leaves((got_params, got_state)),
                         jax.tree.leaves((want_params, want_state))):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(want))

    # Onto other meshes. Same N on a ("data", "model") mesh: same layout, reshard only.
    mesh2, init2, step2, specs2, _ = sharded((4, 1), ("data", "model"))
    ckptr = ocp.StandardCheckpointer()
    target2 = {"params": jax.tree.map(
                   lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype,
                                                  sharding=NamedSharding(mesh2, P())), params),
               "opt_state": abstract_state(jax.eval_shape(init2, params), specs2, mesh2)}
    restored = ckptr.restore(path, target2)
    ckptr.close()
    p2, s2 = run_sharded(step2, restored["params"], restored["opt_state"], 3, 4, np.float32,
                         first=2)
    for got, want in zip(jax.tree.leaves((p2, s2)), jax.tree.leaves((want_params, want_state))):
        np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)

    # Another N: the global layout depends on N, so move the state through its portable
    # form and place it with the new specs.
    mesh8, init8, step8, specs8, _ = sharded((8,))
    portable = muon_optax.export_state(sp.make_tx("data"), restored["opt_state"], params)
    state8 = muon_optax.import_state(sp.make_tx("data"), portable, params, num_devices=8)
    state8 = jax.tree.map(lambda spec, x: jax.device_put(x, NamedSharding(mesh8, spec)),
                          specs8, state8, is_leaf=lambda x: isinstance(x, P))
    # N=8 devices see other gradients than N=4: feed each of the 4 gradients to 2 devices
    # so that the mean, hence the trajectory, is the same.
    p8 = to_np(restored["params"])
    for s in range(2, 5):
        g4 = sp.device_grads(s, range(4))
        p8, state8 = step8(p8, state8, jax.tree.map(lambda g: np.repeat(g, 2, axis=0), g4))
    for k, want in flat(want_params).items():
        got = np.asarray(flat(p8)[k], np.float64)
        p_saved = np.asarray(flat(params)[k], np.float64)
        change = np.linalg.norm(np.asarray(want, np.float64) - p_saved)
        assert np.linalg.norm(got - np.asarray(want)) <= 1e-5 * change + 1e-6, k


# ------------------------------------------------------------------ errors


def test_state_specs_errors():
    params = sp.make_params()
    tx = sp.make_tx("data")
    model_only = sp.make_mesh((2,), ("model",))
    with pytest.raises(ValueError, match="'data'"):
        muon_optax.state_specs(tx, params, model_only)
    with pytest.raises(ValueError, match="axis_name"):
        muon_optax.state_specs(sp.make_tx(None), params, sp.make_mesh((2,)))
    with pytest.raises(TypeError, match="no muon_optax transformation"):
        muon_optax.state_specs(optax.adam(1e-3), params, sp.make_mesh((2,)))
    # Outside shard_map the axis is unbound (jax's NameError today).
    with pytest.raises((NameError, ValueError), match="data"):
        tx.init(params)


# --------------------------------------------------------------- plain jax.jit (mesh=)


def test_mesh_mode_under_plain_jit_matches_single_device_and_shards_state():
    """``muon_adamw(..., axis_name, mesh)``: a jit train step without shard_map of its own
    gets the single-device result, with the state sharded and 1/N of it per device."""
    n = 4
    mesh = sp.make_mesh((n,))
    params = sp.make_params()
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, axis_name="data", mesh=mesh,
                               param_specs=P(),          # replicated (Auto axes, jit)
                               dimension_numbers=sp.DIMS)
    single = sp.make_tx(None)

    def step(tx):
        def apply(params, state, grads):
            updates, state = tx.update(grads, state, params)
            return optax.apply_updates(params, updates), state
        return jax.jit(apply, compiler_options=sp.FAST_COMPILE)

    state, ref_state = jax.jit(tx.init)(params), single.init(params)
    for leaf in jax.tree.leaves(state.muon):
        assert leaf.sharding.spec == P("data")
        assert leaf.addressable_shards[0].data.shape[0] == leaf.shape[0] // n
    got, want = params, params
    sharded_step, single_step = step(tx), step(single)      # one compile each
    for s in range(3):
        grads = sp.mean_grads(sp.device_grads(s, range(n)), np.float32)
        new, state = sharded_step(got, state, grads)
        ref, ref_state = single_step(want, ref_state, grads)
        assert_changes_close(to_np(got), to_np(new), to_np(ref), np.float32, 1e-5)
        got, want = new, ref
    hlo = sharded_step.lower(got, state, grads).compile().as_text()
    assert "all-gather" in hlo


# ------------------------------------------- gradients taken inside shard_map (jax.grad)




def test_grads_inside_shard_map_match_one_device_on_the_global_batch():
    """The README's recipe, end to end: each device's jax.grad at pcast(params) goes to
    tx.update; the step equals one device on the whole batch, and the compiled step
    all-reduces no gradient (reduce-scatter + all-gather: one all-reduce's bytes)."""
    n = 4
    params, groups, labels = sp.tiny_lm()
    mesh = sp.make_mesh((n,))
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state, tokens):
        grads = jax.grad(sp.tiny_lm_loss)(jax.lax.pcast(params, "data", to="varying"), tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    single = muon_optax.muon_adamw(groups, labels)
    state1, p1, p = single.init(params), params, params

    @jax.jit
    def step1(params, state, tokens):
        updates, state = single.update(jax.grad(sp.tiny_lm_loss)(params, tokens), state, params)
        return optax.apply_updates(params, updates), state

    for s in range(3):
        tokens = jax.random.randint(jax.random.PRNGKey(s), (4 * n, 8), 0, 64)
        p, state = step(p, state, tokens)
        p1, state1 = step1(p1, state1, tokens)
    for k in params:
        assert_changes_close({k: params[k]}, {k: to_np(p[k])}, {k: to_np(p1[k])},
                             np.float32, 1e-4)

    ops = sp.collectives(step.lower(p, state, tokens).compile().as_text(), n)
    small = sum(x.size * 4 for k, x in params.items() if x.size < 1024)
    assert ops.get("all-reduce", {"bytes": 0})["bytes"] <= small + 64, ops
    # Reduce-scatter then all-gather of the same (padded) buffers: a ring all-reduce's
    # two halves, the bytes muon_optax.estimate plans for.
    rs, ag = ops["reduce-scatter"]["bytes"], ops["all-gather"]["bytes"]
    big = sum(x.size * 4 for x in params.values() if x.size >= 1024)
    assert rs == ag >= big, (rs, ag, big)
    ring = sum(op["ring"] for op in ops.values())
    assert ring == pytest.approx(muon_optax.estimate(tx, params, n)["collective_bytes"][0])


def test_reduced_gradients_are_refused_inside_shard_map():
    params, groups, labels = sp.tiny_lm()
    mesh = sp.make_mesh((4,))
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state, tokens):
        grads = jax.grad(sp.tiny_lm_loss)(params, tokens)       # summed over "data": invariant
        return tx.update(grads, state, params)

    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    with pytest.raises(ValueError, match=r"pcast\(params, 'data', to='varying'\)"):
        step(params, state, jnp.zeros((16, 8), jnp.int32))


def test_adamw_split_prefers_the_leading_axis():
    # Splitting a minor axis transposes the gradient, the param and both moments every
    # step (1.66x the step time for a (32001, 512) embedding on 8 devices, BENCHMARKS.md)
    # to save a few rows of padding.
    from muon_optax.plan.specs import adamw_shard_axis

    for shape in [(50257, 768), (32001, 4096)]:
        for n in range(2, 65):
            assert adamw_shard_axis(shape, n, 1024) == 0, (shape, n)
    assert adamw_shard_axis((3, 4096), 8, 1024) == 1        # 3 rows over 8: pad 167%
    assert adamw_shard_axis((100,), 8, 1024) is None         # small: replicated
