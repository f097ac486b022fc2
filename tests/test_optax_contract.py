"""The optax contract in every mode: what a chain would do on one device fed the global
batch, the optimizer does with each device's own gradient (ZeRO-2), with global arrays
(``mesh=``) and on one device. 8 simulated CPU devices (tests/conftest.py).

Gradients here are always ``jax.grad`` inside the step, as a user takes them.
"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import PartitionSpec as P

import muon_optax

try:
    from . import sharded_problem as sp
except ImportError:  # plain `pytest` rootdir imports (tests/ is on sys.path)
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8,
                                reason="needs 8 devices (tests/conftest.py sets XLA_FLAGS)")

N = 8
ROWS = 2            # token rows per device
CLIP = 0.005        # below every step's global norm here: clipping acts




def _loss(params, tokens, weight):
    """``weight`` (one per row) lets a test poison one device's rows with NaN."""
    h = params["embed"][tokens] * params.get("gain", 1.0)
    err = (jax.nn.relu(h @ params["w1"]) @ params["w2"] - h) ** 2
    return jnp.mean(err * weight[:, None, None])


def _batches(steps, nan_step=None):
    """Global batches; at ``nan_step`` device 3's rows weigh NaN."""
    out = []
    for s in range(steps):
        tokens = jax.random.randint(jax.random.PRNGKey(s), (ROWS * N, 8), 0, 64)
        weight = np.ones(ROWS * N, np.float32)
        if s == nan_step:
            weight[3 * ROWS] = np.nan
        out.append((tokens, jnp.asarray(weight)))
    return out


def _one_device_run(tx, params, batches):
    state = tx.init(params)

    @jax.jit
    def step(params, state, tokens, weight):
        grads = jax.grad(_loss)(params, tokens, weight)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    for tokens, weight in batches:
        params, state = step(params, state, tokens, weight)
    return params, state


def _zero2_run(tx, params, batches, mesh):
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state, tokens, weight):
        grads = jax.grad(_loss)(jax.lax.pcast(params, "data", to="varying"), tokens, weight)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(train_step, mesh=mesh,
                                 in_specs=(P(), specs, P("data"), P("data")),
                                 out_specs=(P(), specs)))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    for tokens, weight in batches:
        params, state = step(params, state, tokens, weight)
    return params, state


def _run(mode, params, groups, labels, batches, **options):
    if mode == "one device":
        return _one_device_run(muon_optax.muon_adamw(groups, labels, **options), params,
                               batches)
    mesh = sp.make_mesh((N,))
    if mode == "zero2":
        tx = muon_optax.muon_adamw(groups, labels, axis_name="data", **options)
        return _zero2_run(tx, params, batches, mesh)
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data", mesh=mesh, **options)
    return _one_device_run(tx, params, batches)


def _assert_close(got, want, atol=1e-5):
    for k in want:
        np.testing.assert_allclose(np.asarray(got[k]), np.asarray(want[k]), rtol=0,
                                   atol=atol, err_msg=k)


@pytest.mark.parametrize("mode", ["one device", "zero2", "mesh"])
def test_clipping_and_nonfinite_steps_match_the_one_device_chain(mode):
    """max_grad_norm= and skip_nonfinite= on the mean gradient: equal to
    chain(clip_by_global_norm, tx) on one device fed the global batch, a NaN on one
    device skipping the step everywhere (the state, count included, as before it)."""
    params, groups, labels = sp.tiny_lm()
    batches = _batches(4, nan_step=2)
    ref = optax.chain(optax.clip_by_global_norm(CLIP), muon_optax.muon_adamw(groups, labels))
    for tokens, weight in batches[:2]:   # clipping acts at the steps compared
        norm = optax.tree.norm(jax.grad(_loss)(params, tokens, weight))
        assert norm > 2 * CLIP, norm
    want, want_state = _one_device_run(ref, params, batches[:2] + batches[3:])
    got, state = _run(mode, params, groups, labels, batches, max_grad_norm=CLIP,
                      skip_nonfinite=True)
    _assert_close(got, want)
    assert int(state.count) == 3 and int(state.skipped) == 1
    np.testing.assert_allclose(np.asarray(state.nu["embed"])[:64],
                               np.asarray(want_state[1].nu["embed"]), rtol=1e-4, atol=1e-12)


@pytest.mark.parametrize("make", [
    lambda **kw: muon_optax.muon(0.02, compute_dtype=jnp.float32, **kw),
    lambda **kw: muon_optax.adamw(3e-3, weight_decay=0.1, **kw),
    lambda **kw: muon_optax.contrib_muon(0.02, weight_decay=0.1, **kw)],
    ids=["muon", "adamw", "contrib_muon"])
def test_every_constructor_clips_the_mean_gradient_under_zero2(make):
    params, _, _ = sp.tiny_lm()
    if make(max_grad_norm=CLIP).init.options.name == "muon":
        del params["gain"]                  # Muon takes matrices only
    batches = _batches(2)
    want, _ = _one_device_run(optax.chain(optax.clip_by_global_norm(CLIP), make()), params,
                              batches)
    got, _ = _zero2_run(make(axis_name="data", max_grad_norm=CLIP), params, batches,
                        sp.make_mesh((N,)))
    _assert_close(got, want)


@pytest.mark.parametrize("where", ["init", "update"])
def test_params_split_inside_shard_map_are_refused(where):
    """in_specs=P("data") hands each device an 8-row block of each matrix: Muon would
    orthogonalize the blocks, a wrong step without a word. The types show it."""
    params, _, _ = sp.tiny_lm()
    params = {"w1": params["w1"], "w2": params["w2"]}
    mesh = sp.make_mesh((N,))
    tx = muon_optax.muon(0.02, axis_name="data")
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(w)) for w in p.values()))(params)
        return tx.update(grads, state, params)

    if where == "init":
        fn = jax.shard_map(tx.init, mesh=mesh, in_specs=P("data"), out_specs=specs)
        args = (params,)
    else:
        state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(
            params)
        fn = jax.shard_map(train_step, mesh=mesh, in_specs=(P("data"), specs),
                           out_specs=(P("data"), specs))
        args = (params, state)
    with pytest.raises(ValueError, match=r"'w1' varies over mesh axis 'data'.*mesh="):
        jax.jit(fn)(*args)


def _adamw_zero2_state(tx, params, steps=2):
    mesh = sp.make_mesh((N,))
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state, x):
        grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(w * x[0, 0])) for w in p.values()))(
            jax.lax.pcast(params, "data", to="varying"))
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    for s in range(steps):
        params, state = step(params, state, jnp.arange(N, dtype=jnp.float32)[:, None] + s)
    return params, state


def test_export_of_a_zero2_state_without_muon_reads_the_device_count():
    """No Muon buffers to read the device count from: the padded AdamW moments' layout
    says it (export_state used to take one device and fail on the padding)."""
    params = {"embed": np.linspace(-1, 1, 97 * 13, dtype=np.float32).reshape(97, 13),
              "gain": np.ones(5, np.float32)}
    tx = muon_optax.adamw(1e-2, axis_name="data")
    _, state = _adamw_zero2_state(tx, params)
    got = muon_optax.export_state(tx, state, params)
    want = muon_optax.export_state(tx, state, params, num_devices=N)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    assert got["mu"]["embed"].shape == (97, 13)


def test_size_zero_adamw_leaf_stays_whole_under_zero2():
    """small_param_threshold=0 splits every AdamW leaf, but one of size 0 has nothing to
    split (all_gather of its empty slices failed)."""
    params = {"empty": np.zeros((0, 4), np.float32),
              "w": np.linspace(-1, 1, 48, dtype=np.float32).reshape(16, 3)}
    tx = muon_optax.muon_adamw({"a": dict(kind="adamw", lr=1e-2)},
                               lambda p: jax.tree.map(lambda _: "a", p), axis_name="data",
                               small_param_threshold=0)
    got, _ = _adamw_zero2_state(tx, params, steps=1)
    one = muon_optax.adamw(1e-2)
    grads = jax.grad(lambda p: sum(jnp.sum(jnp.sin(w * x)) for w in p.values()
                                   for x in np.arange(N)) / N)(params)
    want = optax.apply_updates(params, one.update(grads, one.init(params), params)[0])
    _assert_close(got, want)
    assert got["empty"].shape == (0, 4)


def test_multisteps_inside_shard_map_points_to_the_accumulation_recipe():
    params, groups, labels = sp.tiny_lm()
    mesh = sp.make_mesh((N,))
    inner = muon_optax.muon_adamw(groups, labels, axis_name="data")
    tx = optax.MultiSteps(inner, 2)
    specs = optax.MultiStepsState(P(), P(), muon_optax.state_specs(inner, params, mesh), P(),
                                  ())

    def train_step(params, state, tokens, weight):
        grads = jax.grad(_loss)(jax.lax.pcast(params, "data", to="varying"), tokens, weight)
        return tx.update(grads, state, params)

    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    step = jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data"), P("data")),
                         out_specs=(P(), specs))
    with pytest.raises(ValueError, match="MultiSteps.*'Gradient accumulation'"):
        jax.jit(step)(params, state, *_batches(1)[0])


def _is_spec(x):
    return isinstance(x, P)


@pytest.mark.parametrize("wrap", ["chain", "multisteps", "apply_if_finite", "partition"])
def test_state_specs_find_the_state_inside_wrappers(wrap):
    params, groups, labels = sp.tiny_lm()
    mesh = sp.make_mesh((N,))
    tx = muon_optax.muon_adamw(groups, labels, axis_name="data")
    inner = muon_optax.state_specs(tx, params, mesh)
    if wrap == "chain":
        outer, want = optax.chain(optax.clip(1.0), tx), (optax.EmptyState(), inner)
    elif wrap == "multisteps":
        outer = optax.MultiSteps(tx, 2)
        want = optax.MultiStepsState(P(), P(), inner, jax.tree.map(lambda _: P(), params), ())
    elif wrap == "apply_if_finite":
        outer = optax.apply_if_finite(tx, 3)
        want = optax.ApplyIfFiniteState(P(), P(), P(), inner)
    else:
        outer = optax.partition({"all": tx, "none": optax.set_to_zero()},
                                jax.tree.map(lambda _: "all", params))
        want = optax.PartitionState({"all": optax.MaskedState(muon_optax.state_specs(
            tx, params, mesh)), "none": optax.MaskedState(optax.EmptyState())})
    got = muon_optax.state_specs(outer, params, mesh)
    assert jax.tree.structure(got, is_leaf=_is_spec) == jax.tree.structure(want,
                                                                          is_leaf=_is_spec)
    assert jax.tree.leaves(got, is_leaf=_is_spec) == jax.tree.leaves(want, is_leaf=_is_spec)


def test_inject_hyperparams_runs_in_every_mode_and_names_static_args():
    """adamw under inject_hyperparams: ZeRO-2 (its state laid out by state_specs), and
    mesh= on an Explicit mesh (the injected lr, an array, enters the engine's shard_map
    as an argument: closing over it failed). A Mesh without static_args is refused with
    the fix."""
    params, _, _ = sp.tiny_lm()
    params = {"embed": params["embed"]}
    mesh = sp.make_mesh((N,))
    inject = optax.inject_hyperparams(muon_optax.adamw, static_args=("axis_name", "mesh"))
    grads = jax.tree.map(lambda x: jnp.cos(x * 3), params)
    one = muon_optax.adamw(1e-2, weight_decay=0.1)
    want = one.update(grads, one.init(params), params)[0]

    tx = inject(lr=1e-2, weight_decay=0.1, axis_name="data")
    specs = muon_optax.state_specs(tx, params, mesh)
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    upd = jax.jit(jax.shard_map(
        lambda g, s, p: tx.update(jax.lax.pcast(g, "data", to="varying"), s, p), mesh=mesh,
        in_specs=(P(), specs, P()), out_specs=(P(), specs)))
    _assert_close(upd(grads, state, params)[0], want, atol=1e-7)

    explicit = jax.make_mesh((N,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    tx = inject(lr=1e-2, weight_decay=0.1, axis_name="data", mesh=explicit)
    with jax.set_mesh(explicit):
        placed = jax.device_put(params, jax.sharding.NamedSharding(explicit, P()))
        state = jax.jit(tx.init)(placed)
        _assert_close(jax.jit(tx.update)(grads, state, placed)[0], want, atol=1e-7)
    with pytest.raises(TypeError, match=r'static_args=\("axis_name", "mesh"\)'):
        optax.inject_hyperparams(muon_optax.adamw)(lr=1e-2, axis_name="data",
                                                   mesh=explicit).init(params)
    with pytest.raises(TypeError, match="schedule"):
        optax.inject_hyperparams(muon_optax.muon_adamw)(
            {"a": dict(kind="adamw", lr=1e-3)},
            lambda p: jax.tree.map(lambda _: "a", p)).init(params)


def test_export_state_finds_the_state_inside_a_chain():
    params = {"embed": np.linspace(-1, 1, 97 * 13, dtype=np.float32).reshape(97, 13)}
    tx = muon_optax.adamw(1e-2, axis_name="data")
    _, state = _adamw_zero2_state(tx, params, steps=1)
    chained = optax.chain(optax.clip(1.0), tx)
    got = muon_optax.export_state(chained, (optax.EmptyState(), state), params)
    want = muon_optax.export_state(tx, state, params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_multisteps_in_the_mesh_form_equals_one_device_on_both_micro_batches():
    """Plain jit (mesh=): the gradients are global arrays, so MultiSteps accumulates
    them as on one device."""
    params, groups, labels = sp.tiny_lm()
    batches = _batches(2)
    tx = optax.MultiSteps(muon_optax.muon_adamw(groups, labels, axis_name="data",
                                                mesh=sp.make_mesh((N,))), 2)
    got, _ = _one_device_run(tx, params, batches)
    both = (jnp.concatenate([b[0] for b in batches]), jnp.concatenate([b[1] for b in batches]))
    want, _ = _one_device_run(muon_optax.muon_adamw(groups, labels), params, [both])
    _assert_close(got, want)
