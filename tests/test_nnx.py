"""Flax NNX as Flax teaches it: a GPT of Flax's standard modules through ``nnx.Optimizer``.

One device and ``mesh=`` on Auto and Explicit meshes, without any hint: the default
labels and dimension numbers fit ``nnx.Embed``, ``nnx.MultiHeadAttention`` and an
``lm_head`` ``nnx.Linear``; the layout of placed params is learned at ``init``; Flax's
own sharding metadata is accepted as ``param_specs``; a checkpoint moves between device
counts through the portable state.
"""

import jax
import jax.numpy as jnp
import nnx_gpt as g
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

STEPS = 3


def _mesh(shape, axis_type=AxisType.Auto):
    names = ("data", "model")[:len(shape)]
    return jax.make_mesh(shape, names, axis_types=(axis_type,) * len(shape),
                         devices=jax.devices()[:int(np.prod(shape))])


def _pure_params(model) -> dict:
    """The params as NumPy, by path, without the attention's key biases: softmax does not
    see them, so their gradient is rounding noise, which Adam scales up to full steps."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(model, nnx.Param)))[0]
    return {muon_optax.path_str(p): np.asarray(x) for p, x in flat
            if not muon_optax.path_str(p).endswith("key/bias")}


def _train(model, opt, steps=STEPS, first=0, step=g.train_step) -> list[float]:
    return [float(step(model, opt, g.tokens(seed=s % 2))) for s in range(first, first + steps)]


@pytest.fixture(scope="module")
def one_device():
    """The one-device run: losses and params after ``STEPS`` steps through nnx.Optimizer."""
    model = g.GPT(nnx.Rngs(0))
    opt = nnx.Optimizer(model, g.make_tx(), wrt=nnx.Param)
    losses = _train(model, opt)
    return losses, _pure_params(model), opt


# ------------------------------------------------------------------ defaults


def test_describe_reads_flax_modules_as_nanochat_matrices():
    """An attention kernel is one matrix (in x heads*head_dim, heads*head_dim x out), as
    nanochat's c_q/c_proj; the embedding and the lm_head go to AdamW."""
    model = g.GPT(nnx.Rngs(0))
    rows = {r["path"]: r for r in muon_optax.describe(
        g.make_tx(), nnx.state(model, nnx.Param), file=None)}
    hd = g.D   # heads * head_dim
    for name in ("query", "key", "value"):
        row = rows[f"blocks/0/attn/{name}/kernel"]
        assert (row["group"], row["matrices"], row["matrix"]) == ("muon", 1, (hd, g.D)), row
    row = rows["blocks/1/attn/out/kernel"]
    assert (row["group"], row["matrices"], row["matrix"]) == ("muon", 1, (g.D, hd)), row
    assert rows["blocks/0/fc/kernel"]["matrix"] == (4 * g.D, g.D)
    for name in ("embed/embedding", "lm_head/kernel", "blocks/0/attn/query/bias",
                 "blocks/0/ln2/scale"):
        assert rows[name]["group"] == "adamw", rows[name]


def test_scanned_attention_is_one_matrix_per_layer():
    """nnx.vmap'd attention: (L, in, heads, head_dim) is L matrices; a scanned Linear
    named ``out`` outside attention keeps the default (last two axes)."""

    class Layers(nnx.Module):
        def __init__(self, rngs):
            @nnx.vmap(in_axes=0, out_axes=0)
            def make(key):
                return nnx.MultiHeadAttention(num_heads=4, in_features=32, qkv_features=16,
                                              decode=False, rngs=nnx.Rngs(key))

            self.attn = make(jax.random.split(rngs.params(), 3))
            self.out = nnx.Param(jnp.ones((3, 16, 8)))

    params = jax.eval_shape(lambda: nnx.as_pure(nnx.state(Layers(nnx.Rngs(0)), nnx.Param)))
    rows = {r["path"]: r for r in muon_optax.describe(g.make_tx(), params, file=None)}
    assert rows["attn/query/kernel"]["shape"] == (3, 32, 4, 4)
    assert (rows["attn/query/kernel"]["matrices"], rows["attn/query/kernel"]["matrix"]) == (
        3, (16, 32))
    assert (rows["attn/out/kernel"]["matrices"], rows["attn/out/kernel"]["matrix"]) == (
        3, (32, 16))
    assert (rows["out"]["matrices"], rows["out"]["matrix"]) == (3, (8, 16))


def test_one_device_nnx_optimizer(one_device):
    """nnx.Optimizer on one device trains, with AdamW moments for the embedding and the
    head and one Muon stack for the four attention projections of both blocks."""
    losses, _, opt = one_device
    assert losses[-1] < losses[0]
    state = nnx.as_pure(opt.opt_state)
    assert state.mu["lm_head"]["kernel"].shape == (g.D, g.VOCAB)
    assert state.mu["embed"]["embedding"].shape == (g.VOCAB, g.D)
    info = opt.tx.init.stack_info(nnx.as_pure(nnx.state(g.GPT(nnx.Rngs(0)), nnx.Param)))
    attn = [s for s in info if any("attn" in m for m in s["members"])]
    assert [(s["shape"], s["size"]) for s in attn] == [((g.D, g.D), 4 * g.LAYERS)]


def test_example_gpt_groups_refine_the_defaults():
    """examples/gpt's custom model is laid out as Flax's modules: its rules name
    nanochat's five groups, each inside the group the defaults give."""
    import sys
    from pathlib import Path

    example = Path(__file__).resolve().parents[1] / "examples" / "gpt"
    if str(example) not in sys.path:
        sys.path.insert(0, str(example))
    import model as gpt_model
    import optim_setup

    params = nnx.state(gpt_model.GPT(gpt_model.GPTConfig(n_layer=2, n_embd=64, n_head=2),
                                     rngs=nnx.Rngs(0)), nnx.Param)
    pairs = set(zip(jax.tree.leaves(optim_setup.param_labels(params)),
                    jax.tree.leaves(muon_optax.label_by_path()(params))))
    assert pairs == {("embed", "adamw"), ("lm_head", "adamw"), ("resid", "adamw"),
                     ("x0", "adamw"), ("matrix", "muon")}


# ------------------------------------------------------------------ mesh= without hints


def _explicit_step():
    """The train step on an Explicit mesh: FSDP's all-gather of the params first."""

    def loss_fn(model, tokens):
        graphdef, state = nnx.split(model)
        whole = jax.tree.map(lambda x: jax.sharding.reshard(x, P()), state)
        return g.loss_fn(nnx.merge(graphdef, whole), tokens)

    @nnx.jit
    def step(model, optimizer, tokens):
        loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
        optimizer.update(model, grads)
        return loss

    return step


@pytest.mark.parametrize("shape,axis_type,tp", [
    ((8,), AxisType.Auto, False), ((2, 4), AxisType.Auto, True),
    ((8,), AxisType.Explicit, False)], ids=["auto-fsdp", "auto-fsdp-tp", "explicit-fsdp"])
def test_mesh_nnx_optimizer_learns_the_layout(one_device, shape, axis_type, tp):
    """Params placed FSDP (and TP) on a mesh, nnx.Optimizer without param_specs: the
    optimizer step's only collectives are two all-to-alls (no gather of a split leaf),
    and training follows the one-device run."""
    mesh = _mesh(shape, axis_type)
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0))
        g.place(model, mesh, tp)
        tx = g.make_tx(axis_name=mesh.axis_names, mesh=mesh)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        ops = g.optimizer_collectives(tx, opt, model, mesh.size)
        assert set(ops) == {"all-to-all"} and ops["all-to-all"]["count"] == 2, ops
        step = _explicit_step() if axis_type == AxisType.Explicit else g.train_step
        losses = _train(model, opt, step=step)
    want_losses, want_params, _ = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got_params = _pure_params(model)
    for path, want in want_params.items():
        np.testing.assert_allclose(got_params[path], want, rtol=1e-4, atol=1e-5, err_msg=path)


@pytest.mark.parametrize("n", [2, 4])
@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit])
def test_mesh_nnx_optimizer_keeps_replicated_adamw_moments_whole_below_4_devices(
        one_device, axis_type, n):
    """Data parallel under plain jit (params replicated, ``nnx.Optimizer``,
    ``nnx.value_and_grad``): on 2 devices the embedding's and head's AdamW moments are
    whole on each (their update not gathered), on 4 split; training follows one device."""
    mesh = _mesh((n,), axis_type)
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0))
        state = nnx.as_pure(nnx.state(model, nnx.Param))
        nnx.update(model, jax.tree.map(
            lambda x: jax.device_put(x, NamedSharding(mesh, P())), state))
        opt = nnx.Optimizer(model, g.make_tx(axis_name="data", mesh=mesh), wrt=nnx.Param)
        losses = _train(model, opt)
    moments = nnx.as_pure(opt.opt_state)
    for x in (moments.mu["embed"]["embedding"], moments.nu["lm_head"]["kernel"]):
        assert x.sharding.is_fully_replicated == (n < 4), (n, x.sharding)
    want_losses, want_params, _ = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got_params = _pure_params(model)
    for path, want in want_params.items():
        np.testing.assert_allclose(got_params[path], want, rtol=1e-4, atol=1e-5, err_msg=path)


def test_mesh_nnx_optimizer_in_the_tpu_forms(one_device, monkeypatch):
    """The FSDP run above (nnx.Optimizer, ``nnx.value_and_grad``) with the transports in
    their TPU form, cut into pieces and ordered by the TPU's optimization barriers
    (forced on XLA:CPU): training still follows the one-device run."""
    from muon_optax.rule import platform

    for site in ("exchange", "gather", "order"):
        monkeypatch.setitem(platform.FORCED, site, "tpu")
    mesh = _mesh((8,), AxisType.Auto)
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0))
        g.place(model, mesh, False)
        tx = g.make_tx(axis_name=mesh.axis_names, mesh=mesh)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        ops = g.optimizer_collectives(tx, opt, model, mesh.size)
        assert set(ops) == {"all-to-all"} and ops["all-to-all"]["count"] > 2, ops  # pieces
        losses = _train(model, opt, step=g.train_step)
    want_losses, want_params, _ = one_device
    np.testing.assert_allclose(losses, want_losses, rtol=1e-5)
    got_params = _pure_params(model)
    for path, want in want_params.items():
        np.testing.assert_allclose(got_params[path], want, rtol=1e-4, atol=1e-5, err_msg=path)


def _close_but_mask_flips(got, want, path: str) -> None:
    """``got`` equals ``want`` to rounding, but where cautious decay's mask flipped on a
    rounding-level difference: a few elements (at most 1 in 10,000), each moved by at most
    Muon's ``lr wd |p|`` a step."""
    diff = np.abs(got - want)
    off = diff > 2e-4 + 1e-4 * np.abs(want)
    assert off.sum() <= max(1, want.size // 10_000), (path, int(off.sum()))
    muon = g.GROUPS["muon"]
    bound = STEPS * muon["lr"] * muon["weight_decay"] * np.abs(want[off]) + 2e-4
    assert np.all(diff[off] <= bound), (path, diff[off], bound)


# Every TPU form of the sharded step (pieces, barriers, tile order, chunk loops).
TPU_FORMS = ("exchange", "gather", "order", "tiles", "loop", "remainder")


def _fsdp_training(monkeypatch, forms, n, axis_type=AxisType.Auto):
    """The README's FSDP run (``nnx.Optimizer``, ``nnx.value_and_grad``, ``mesh=``) on
    ``n`` devices with the sites ``forms`` in their TPU form (forced on XLA:CPU): its
    losses and params."""
    from muon_optax.rule import platform

    with monkeypatch.context() as m:
        for site in forms:
            m.setitem(platform.FORCED, site, "tpu")
        mesh = _mesh((n,), axis_type)
        with jax.set_mesh(mesh):
            model = g.GPT(nnx.Rngs(0))
            g.place(model, mesh, False)
            opt = nnx.Optimizer(model, g.make_tx(axis_name=mesh.axis_names, mesh=mesh),
                                wrt=nnx.Param)
            step = _explicit_step() if axis_type == AxisType.Explicit else g.train_step
            return _train(model, opt, step=step), _pure_params(model)


def test_mesh_nnx_optimizer_with_tiled_buffers_and_tpu_chunks(monkeypatch):
    """The README's FSDP run (nnx.Optimizer, ``nnx.value_and_grad``, ``mesh=``) at width
    128, whose matrices and blocks are whole (8, 128) tiles, with chunks of one
    (128, 128) matrix: every TPU form forced on XLA:CPU (pieces, barriers, buffers in tile
    order, an exchange stack's chunks one by one, no loop: ``sharded._unlooped_runs``)
    trains bit for bit as the CPU form."""
    from muon_optax.step import matrices, rows, sharded

    monkeypatch.setattr(g, "D", 128)
    monkeypatch.setattr(g, "LAYERS", 4)
    monkeypatch.setattr(matrices, "chunk_bytes", lambda plan: 4 * 128 * 128)
    tiled = []
    real_tiled = rows._tiled
    monkeypatch.setattr(rows, "_tiled", lambda *a: tiled.append(real_tiled(*a)) or tiled[-1])
    loops, real_loop = [], sharded._base_loop
    monkeypatch.setattr(sharded, "_base_loop", lambda *a: loops.append(1) or real_loop(*a))

    want_losses, want = _fsdp_training(monkeypatch, (), 8)
    got_losses, got = _fsdp_training(monkeypatch, TPU_FORMS, 8)
    assert any(tiled) and not loops   # the tile order taken; exchange stacks never loop
    assert got_losses == want_losses
    for path, x in want.items():
        np.testing.assert_array_equal(got[path], x, err_msg=path)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_mesh_nnx_optimizer_with_a_slot_some_devices_do_not_own_in_a_loop(monkeypatch,
                                                                          axis_type):
    """The README's FSDP run (nnx.Optimizer, ``nnx.value_and_grad``, ``mesh=``, Auto and
    Explicit axes) on 4 devices with 5 layers: the MLP stack (c_fc, and c_proj stored wide)
    is two matrices a device and one more on two of them. In the TPU forms (forced on
    XLA:CPU) that slot runs on its own (an exchange stack never loops:
    ``sharded._unlooped_runs``) on every device, masked where not owned (the CPU form:
    under a ``cond``); training follows the CPU form to rounding (XLA:CPU fuses the kernel
    inside a ``cond`` otherwise; three steps carry it to 3e-7). The unowned slots' state is
    checked in tests/test_collectives.py."""
    from muon_optax.step import matrices, sharded

    monkeypatch.setattr(g, "D", 128)
    monkeypatch.setattr(g, "LAYERS", 5)
    monkeypatch.setattr(matrices, "chunk_bytes", lambda plan: 4 * 128 * 128)
    masked, real_owned = [], sharded._owned
    monkeypatch.setattr(sharded, "_owned",
                        lambda sp, comm, j: masked.append(j) or real_owned(sp, comm, j))

    want_losses, want = _fsdp_training(monkeypatch, (), 4, axis_type)
    masked.clear()   # (the CPU run traces the TPU form too, lax.platform_dependent)
    got_losses, got = _fsdp_training(monkeypatch, TPU_FORMS, 4, axis_type)
    assert 2 in masked and not any(isinstance(j, jax.Array) for j in masked)  # alone
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    for path, x in want.items():
        _close_but_mask_flips(got[path], x, path)


def test_mesh_nnx_optimizer_with_equal_chunks_under_the_budget(monkeypatch):
    """The README's FSDP run on 2 devices with 5 layers and chunks of four (128, 128)
    matrices. In the TPU forms (forced on XLA:CPU) each device's 10 attention matrices
    of a stack go in 5 chunks of 2 (the CPU form: 4, 4 and 2), and its 5 MLP matrices
    (c_fc, and c_proj stored wide) one by one, none in a loop (an exchange stack:
    ``sharded._unlooped_runs``). Training follows the CPU form to rounding. (A slot under
    a ``cond``, which 2 devices no longer have: tests/test_collectives.py.)"""
    from muon_optax.step import matrices, sharded

    monkeypatch.setattr(g, "D", 128)
    monkeypatch.setattr(g, "LAYERS", 5)
    monkeypatch.setattr(matrices, "chunk_bytes", lambda plan: 4 * 4 * 128 * 128)
    loops, real_loop = [], matrices.kernel_in_loop
    monkeypatch.setattr(matrices, "kernel_in_loop", lambda st, g_all, per, *a: loops.append(
        (st.rows, st.cols, g_all.shape[0], per)) or real_loop(st, g_all, per, *a))
    steps, real_step = [], sharded._stack_step
    monkeypatch.setattr(sharded, "_stack_step", lambda k, sp, plan, *a: steps.append(
        (sp.stack.rows, sp.stack.cols, sharded._runs(sp, plan, a[-1])))
        or real_step(k, sp, plan, *a))

    want_losses, want = _fsdp_training(monkeypatch, (), 2)
    loops.clear()   # (the CPU run traces the TPU form too)
    steps.clear()
    got_losses, got = _fsdp_training(monkeypatch, TPU_FORMS, 2)
    assert not loops, loops
    assert (128, 128, [[(j, j + 2)] for j in range(0, 10, 2)]) in steps, steps
    assert (128, 512, [[(j, j + 1)] for j in range(5)]) in steps, steps
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    for path, x in want.items():
        _close_but_mask_flips(got[path], x, path)


def _heads_spec(path: str, x) -> P:
    """Megatron-style tensor parallelism over ``"model"``: attention kernels and biases
    split on heads, the MLP's first matrix on its outputs, its second on its inputs."""
    if any(f"{k}/" in path for k in ("query", "key", "value")):
        return P(None, "model", None) if path.endswith("kernel") else P("model", None)
    return {"attn/out/kernel": P("model", None, None), "fc/kernel": P(None, "model"),
            "fc/bias": P("model"), "proj/kernel": P("model", None)}.get(
        path.split("/", 2)[-1], P())


def _head_parallel_training(monkeypatch, forms, axis_type):
    """Per-head blocks under head-parallel tensor parallelism, the README's way: Flax's
    modules placed on a ``("data", "model")`` mesh, ``muon_adamw(axis_name="model",
    mesh=)`` through ``nnx.Optimizer`` and ``nnx.value_and_grad``, with the sites
    ``forms`` in their TPU form (forced on XLA:CPU); chunks of 4 head blocks."""
    from muon_optax.rule import platform
    from muon_optax.step import matrices

    head_bytes = 4 * g.D * (g.D // g.HEADS)
    with monkeypatch.context() as m:
        for site in forms:
            m.setitem(platform.FORCED, site, "tpu")
        m.setattr(matrices, "chunk_bytes", lambda plan: 4 * head_bytes)
        mesh = _mesh((2, 2), axis_type)
        with jax.set_mesh(mesh):
            model = g.GPT(nnx.Rngs(0))
            params = nnx.as_pure(nnx.state(model, nnx.Param))
            nnx.update(model, jax.tree_util.tree_map_with_path(lambda p, x: jax.device_put(
                x, NamedSharding(mesh, _heads_spec(muon_optax.path_str(p), x))), params))
            params = nnx.as_pure(nnx.state(model, nnx.Param))   # placed
            tx = g.make_tx(axis_name="model", mesh=mesh,
                           dimension_numbers=g.attention_dims(g.HEADS))
            opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
            ops = g.optimizer_collectives(tx, opt, model, mesh.size)
            step = _explicit_step() if axis_type == AxisType.Explicit else g.train_step
            return _train(model, opt, step=step), _pure_params(model), tx, params, ops


@pytest.fixture(scope="module")
def head_blocks_one_device():
    """The one-device run with the per-head blocks: what both axis types follow (one
    trace of its step, not one for each)."""
    model = g.GPT(nnx.Rngs(0))
    one = nnx.Optimizer(model, g.make_tx(dimension_numbers=g.attention_dims(g.HEADS)),
                        wrt=nnx.Param)
    return _train(model, one), _pure_params(model)


@pytest.mark.parametrize("axis_type", [AxisType.Auto, AxisType.Explicit],
                         ids=["auto", "explicit"])
def test_head_parallel_nnx_optimizer_in_the_tpu_forms(monkeypatch, axis_type,
                                                      head_blocks_one_device):
    """Head-parallel attention with per-head blocks: each device's heads are updated where
    they lie (q, k and v blocks stored wide, one local stack with the output projection's),
    only the MLP's matrices move (all-to-all). In the TPU forms (forced on XLA:CPU) the
    local stack's 16 blocks a device go in 4 chunks, none in a loop, each loaded from its
    leaves (``sharded._unlooped_runs``); training follows the CPU form, and that follows
    the one-device run with the same blocks."""
    from muon_optax.step import sharded

    runs, real_runs = [], sharded._unlooped_runs
    monkeypatch.setattr(sharded, "_unlooped_runs",
                        lambda base, cap: runs.append((base, cap)) or real_runs(base, cap))
    want_losses, want, tx, params, ops = _head_parallel_training(monkeypatch, (), axis_type)
    assert set(ops) == {"all-to-all"}, ops            # the MLP's; no head moves
    rows = {r["path"]: r for r in muon_optax.describe(tx, params)}
    stacks = {rows[f"blocks/0/attn/{k}/kernel"]["stack"] for k in ("query", "value", "out")}
    assert len(stacks) == 1, stacks                    # (head_dim, d) blocks, one stack
    runs.clear()   # (the CPU run traces the TPU form too)
    got_losses, got, *_ = _head_parallel_training(monkeypatch, TPU_FORMS, axis_type)
    assert (4 * g.LAYERS * g.HEADS // 2, 4) in runs, runs   # 16 blocks in chunks of 4
    np.testing.assert_allclose(got_losses, want_losses, rtol=1e-6)
    for path, x in want.items():
        _close_but_mask_flips(got[path], x, path)

    one_losses, one_params = head_blocks_one_device      # one device, the same blocks
    np.testing.assert_allclose(one_losses, want_losses, rtol=1e-5)
    for path, x in one_params.items():
        np.testing.assert_allclose(want[path], x, rtol=1e-4, atol=1e-5, err_msg=path)


def test_traced_init_on_auto_mesh_asks_for_param_specs():
    """Where the layout cannot be known (traced on Auto axes, never seen placed), the
    error names param_specs instead of gathering split leaves silently."""
    mesh = _mesh((8,))
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0))
        g.place(model, mesh)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        tx = g.make_tx(axis_name="data", mesh=mesh)
        with pytest.raises(ValueError, match=r"'blocks/0/attn/key/bias'.*Auto.*param_specs.*P\(\)"):
            jax.jit(tx.init)(params)
        with pytest.raises(ValueError, match="param_specs"):
            state = jax.eval_shape(g.make_tx(axis_name="data", mesh=mesh, param_specs=P()).init,
                                   params)
            jax.jit(tx.update)(params, state, params)
        replicated = g.make_tx(axis_name="data", mesh=mesh, param_specs=P())
        jax.jit(replicated.init)(params)                       # P(): all replicated


# ------------------------------------------------------------------ Flax's metadata


def test_flax_sharding_metadata_and_boxed_trees():
    """nnx.get_partition_spec / nnx.get_named_sharding as param_specs, labels and
    dimension numbers as trees of nnx.Variable boxes, nnx.as_pure params at init: all
    accepted, and the optimizer step is two all-to-alls."""
    mesh = _mesh((8,))
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0), partitioned=True)
        state = nnx.state(model, nnx.Param)
        labels = muon_optax.label_by_path()(state)     # a tree of nnx.Param boxes
        flax_layout = muon_optax.MuonDimensionNumbers(reduction_axis=0, output_axis=1)
        dims = jax.tree.map(lambda x: flax_layout if x.ndim == 2 else None, state)
        for specs in (nnx.get_partition_spec(state), nnx.get_named_sharding(state, mesh)):
            tx = muon_optax.muon_adamw(g.GROUPS, labels, dimension_numbers=dims,
                                       axis_name="data", mesh=mesh, param_specs=specs)
            jax.jit(tx.init)(nnx.as_pure(state))               # traced: specs needed
            opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
            ops = g.optimizer_collectives(tx, opt, model, 8)
            assert set(ops) == {"all-to-all"} and ops["all-to-all"]["count"] == 2, ops
        losses = _train(model, opt)
        pure = nnx.as_pure(state)
        boxed = muon_optax.estimate(tx, pure, 8, param_specs=nnx.get_partition_spec(state))
        plain = muon_optax.estimate(tx, pure, 8, param_specs=jax.tree.map(
            lambda x: x.sharding.spec, pure))
        assert boxed["state_bytes"] == plain["state_bytes"]
    assert np.isfinite(losses).all()


# ------------------------------------------------------------------ checkpoints


def test_nnx_checkpoint_moves_between_device_counts(one_device, tmp_path):
    """Save params and the portable state (orbax) under FSDP on 8 devices, restore on a
    4-device mesh and on one device into fresh nnx.Optimizers
    (``load_nnx_optimizer_state``): the next step is the uninterrupted run's."""
    ocp = pytest.importorskip("orbax.checkpoint")
    mesh = _mesh((8,))
    with jax.set_mesh(mesh):
        model = g.GPT(nnx.Rngs(0))
        g.place(model, mesh)
        tx = g.make_tx(axis_name="data", mesh=mesh)
        opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
        _train(model, opt)
        params = nnx.as_pure(nnx.state(model, nnx.Param))
        portable = muon_optax.export_state(tx, nnx.as_pure(opt.opt_state), params)
        ckptr = ocp.StandardCheckpointer()
        ckptr.save(tmp_path / "ckpt", {"params": params, "opt": portable})
        ckptr.wait_until_finished()
        want = _train(model, opt, first=STEPS)            # the second reads the state

    for n in (4, 1):
        mesh = _mesh((n,))
        with jax.set_mesh(mesh):
            model = g.GPT(nnx.Rngs(1))                        # other values: overwritten
            if n > 1:
                g.place(model, mesh)
            tx = g.make_tx(axis_name="data", mesh=mesh) if n > 1 else g.make_tx()
            opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
            params = nnx.as_pure(nnx.state(model, nnx.Param))
            portable = jax.eval_shape(
                lambda p: muon_optax.export_state(tx, nnx.as_pure(opt.opt_state), p), params)
            whole = NamedSharding(mesh, P())
            target = {"params": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                          x.shape, x.dtype, sharding=x.sharding), params),
                      "opt": jax.tree.map(lambda x: jax.ShapeDtypeStruct(
                          x.shape, x.dtype, sharding=whole), portable)}
            restored = ocp.StandardCheckpointer().restore(tmp_path / "ckpt", target)
            nnx.update(model, restored["params"])
            muon_optax.load_nnx_optimizer_state(
                opt, muon_optax.import_state(tx, restored["opt"], restored["params"]))
            assert int(opt.step[...]) == STEPS
            got = _train(model, opt, first=STEPS)
        np.testing.assert_allclose(got, want, rtol=1e-5)


def test_load_nnx_optimizer_state_refuses_another_optimizers_state():
    model = g.GPT(nnx.Rngs(0))
    opt = nnx.Optimizer(model, g.make_tx(), wrt=nnx.Param)
    other = optax.adam(1e-3).init(nnx.as_pure(nnx.state(model, nnx.Param)))
    with pytest.raises(ValueError, match="transformation given to nnx.Optimizer"):
        muon_optax.load_nnx_optimizer_state(opt, other)
