"""Muon blocks: every block is one Muon matrix, exactly, in every mode.

The reference for a blocked leaf is the plain rule (no blocks) run on the same leaf
reshaped into a batch of its blocks. One params tree holds the README's examples
(per-head ``c_q``, Group Muon, fused QKV split into q, k, v and into heads, fused
gate/up, per-head input blocks of an output projection, an attention kernel with head
axes, a scanned stack, experts), in Flax and PyTorch layouts, tall and wide blocks,
beside whole matrices (one of the blocks' stored shape, so they share a stack) and
AdamW leaves. Fed the same gradients, the blocked tree and the reshaped tree must take
the same steps (1e-6 relative, float32) on one device, in ZeRO-2 and in the ``mesh=``
form, each mode against the reference in the same mode; and each sharded mode the
one-device steps to 1e-5 (the rounding any tree's sharded step differs by: the
reference tree itself is 3e-6 off between ZeRO-2 and one device).
"""

import sys
import warnings
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax
from muon_optax import MuonDimensionNumbers as D

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.common import busiest_over_optimum, nanochat_blocks, stack_costs  # noqa: E402

H, HD, W = 8, 4, 32            # heads, head size, width (H * HD == W)
DM = ("data", "model")

# name: (shape, blocked dims, reference shape, reference dims). The reference shape is
# a reshape of the leaf (row-major), so reshape back gives the leaf's update.
CASES = {
    # Flax layout (in, out)
    "q_heads": ((W, W), D(0, 1, output_blocks=H), (W, H, HD), D(0, 2)),
    "q_groups": ((W, W), D(0, 1, output_blocks=H // 2), (W, H // 2, 2 * HD), D(0, 2)),
    "qkv": ((W, 3 * W), D(0, 1, output_blocks=3), (W, 3, W), D(0, 2)),
    "qkv_heads": ((W, 3 * W), D(0, 1, output_blocks=3 * H), (W, 3 * H, HD), D(0, 2)),
    "gate_up": ((W, 8 * W), D(0, 1, output_blocks=2), (W, 2, 4 * W), D(0, 2)),   # tall
    "proj_heads": ((W, W), D(0, 1, reduction_blocks=H), (H, HD, W), D(1, 2)),   # tall
    "both": ((2 * W, 3 * W), D(0, 1, reduction_blocks=2, output_blocks=3),
             (2, W, 3, W), D(1, 3)),
    "mha_q": ((W, H, HD), D(0, (1, 2), output_blocks=H), (W, H, HD), D(0, 2)),
    "mha_out": ((H, HD, W), D((0, 1), 2, reduction_blocks=H), (H, HD, W), D(1, 2)),
    "scan_q": ((2, W, W), D(1, 2, output_blocks=H), (2, W, H, HD), D(1, 3)),
    "experts": ((H, W, 2 * W), D(1, 2), (H, W, 2 * W), D(1, 2)),
    # PyTorch layout (out, in)
    "pt_q_heads": ((W, W), D(1, 0, output_blocks=H), (H, HD, W), D(2, 1)),
    "pt_proj_heads": ((W, W), D(1, 0, reduction_blocks=H), (W, H, HD), D(2, 0)),
    "pt_gate_up": ((8 * W, W), D(1, 0, output_blocks=2), (2, 4 * W, W), D(2, 1)),
    # whole matrices: the first has the per-head blocks' shape (out HD x in W)
    "whole_like_block": ((W, HD), None, (W, HD), None),
    "whole": ((W, 2 * W), None, (W, 2 * W), None),
}
ADAMW = {"embed": (40, W), "gain": (W,)}

GROUPS = {
    "adamw": dict(kind="adamw", lr=0.01, betas=(0.8, 0.95), eps=1e-10, weight_decay=0.1),
    "muon": dict(kind="muon", lr=optax.linear_schedule(0.02, 0.005, 10),
                 momentum=optax.linear_schedule(0.85, 0.95, 10), beta2=0.95,
                 weight_decay=0.2, compute_dtype=np.float32),
}


def trees(blocked: bool):
    """``(shapes, dims, labels)`` of the blocked tree or of its reshaped reference."""
    shapes = {k: (c[0] if blocked else c[2]) for k, c in CASES.items()} | ADAMW
    dims = {k: (c[1] if blocked else c[3]) for k, c in CASES.items()} | {k: None
                                                                          for k in ADAMW}
    labels = {k: ("adamw" if k in ADAMW else "muon") for k in shapes}
    return shapes, dims, labels


def make_tx(blocked: bool, **kw):
    _, dims, labels = trees(blocked)
    return muon_optax.muon_adamw(GROUPS, labels, dimension_numbers=dims, **kw)


def values(step: int, shapes: dict, scale: float = 0.5) -> dict:
    rng = np.random.default_rng(step)
    return {k: (scale * rng.standard_normal(shapes[k])).astype(np.float32)
            for k in sorted(shapes)}


def to_reference(tree: dict) -> dict:
    ref_shapes, _, _ = trees(False)
    return {k: np.asarray(x).reshape(ref_shapes[k]) for k, x in tree.items()}


def identity(tree: dict, *_) -> dict:
    return tree


def run(blocked: bool, steps: int, make_step=None, put=identity, **kw) -> list[dict]:
    """Params after each step (leaf-shaped), the blocked tree or its reference.

    ``make_step(tx, params) -> (init, step)``: the mode (default one device, jit);
    ``put`` places a tree (params or grads) where the mode wants it.
    """
    shapes, _, _ = trees(True)
    conv = identity if blocked else to_reference
    tx = make_tx(blocked, **kw)
    params = put(conv(values(0, shapes)), blocked)
    if make_step is None:
        init, step = tx.init, jax.jit(lambda p, s, g: _apply(tx, p, s, g))
    else:
        init, step = make_step(tx, params)
    state, out = init(params), []
    for s in range(steps):
        params, state = step(params, state, put(conv(values(s + 1, shapes)), blocked))
        out.append({k: np.asarray(x).reshape(shapes[k]) for k, x in params.items()})
    return out


def _apply(tx, p, s, g):
    u, s = tx.update(g, s, p)
    return optax.apply_updates(p, u), s


def assert_same_steps(got: list, want: list, before: dict, tol: float = 1e-6) -> None:
    """After every step, each leaf's distance from the reference within ``tol`` of how
    far the reference has moved (a relative error of the change, not of the params)."""
    for s, (g, w) in enumerate(zip(got, want)):
        for k in w:
            change = np.asarray(w[k], np.float64) - np.asarray(before[k], np.float64)
            err = np.linalg.norm(np.asarray(g[k], np.float64) - np.asarray(w[k], np.float64))
            assert err <= tol * np.linalg.norm(change), (k, s, err / np.linalg.norm(change))


STEPS = 3


@pytest.fixture(scope="module")
def reference():
    """The reshaped tree on one device."""
    return run(False, STEPS)


def test_one_device_equals_the_rule_on_the_reshaped_leaf(reference):
    shapes, _, _ = trees(True)
    assert_same_steps(run(True, STEPS), reference, values(0, shapes))
    # Blocks of one stored shape stack with whole matrices of that shape; PyTorch-layout
    # blocks are stored the other way round, in a stack of their own.
    rows = {r["path"]: r for r in muon_optax.describe(make_tx(True), values(0, shapes))}
    assert rows["q_heads"]["stack"] == rows["whole_like_block"]["stack"] \
        == rows["mha_q"]["stack"] != rows["pt_q_heads"]["stack"]
    assert rows["q_heads"]["matrices"] == H and rows["q_heads"]["matrix"] == (HD, W)
    assert rows["q_heads"]["blocks"] == (H, 1) and rows["proj_heads"]["blocks"] == (1, H)
    assert rows["both"]["matrices"] == 6 and rows["scan_q"]["matrices"] == 2 * H


def test_portable_state_of_a_blocked_tree_round_trips(reference):
    """Export on one device, import for 8 (ZeRO-2): the next step matches."""
    shapes, _, _ = trees(True)
    tx = make_tx(True)
    params = values(0, shapes)
    state = tx.init(params)
    params, state = jax.jit(lambda p, s, g: _apply(tx, p, s, g))(params, state, values(1, shapes))
    portable = muon_optax.export_state(tx, state, params)
    assert portable["momentum"]["q_heads"].shape == (W, W)
    back = muon_optax.import_state(tx, portable, params)
    for a, b in zip(jax.tree.leaves(back), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_zero2_equals_the_rule_on_the_reshaped_leaf(reference):
    shapes, _, _ = trees(True)
    mesh = sp.make_mesh((8,))

    def make_step(tx, params):
        init, step, _ = sp.sharded_fns(tx, params, mesh)
        replicated = NamedSharding(mesh, P())

        def same_grads(p, s, g):   # every device the same gradient
            # The params placed as the step returns them, the first step's too: one
            # compile, not a second for the NumPy params of the first call.
            p = jax.device_put(p, replicated)
            return step(p, s, {k: np.broadcast_to(x, (8,) + x.shape) for k, x in g.items()})
        return init, same_grads

    got = run(True, STEPS, make_step, axis_name="data")
    assert_same_steps(got, run(False, STEPS, make_step, axis_name="data"), values(0, shapes))
    assert_same_steps(got, reference, values(0, shapes), tol=1e-5)
    rows = {r["path"]: r for r in muon_optax.describe(make_tx(True, axis_name="data"),
                                                      values(0, shapes), num_devices=8)}
    assert len(rows["qkv_heads"]["owners"]) > 1     # blocks of one leaf, several owners


# mesh= layouts on the (4, 2) ("data", "model") mesh: head-parallel on block boundaries
# (each device holds whole blocks: "local"), FSDP within blocks ("exchange"), experts on
# E, and layouts the transports do not move (blocks split over only some owner axes, or
# both split and cut: gathered whole, with a warning). Each spec with the reference
# tree's: the same split of the reshaped leaf.
MESH_SPECS = {
    "q_heads": (P(None, DM), P(None, DM, None)),          # 8 heads on 8 devices: local
    "qkv_heads": (P(None, DM), P(None, DM, None)),        # 24 blocks, 3 per device
    "proj_heads": (P(DM, None), P(DM, None, None)),       # input blocks, a head each
    "pt_q_heads": (P(DM, None), P(DM, None, None)),       # PyTorch layout, heads on rows
    "mha_q": (P(None, DM, None), P(None, DM, None)),      # the heads axis itself
    "experts": (P(DM, None, None), P(DM, None, None)),    # experts on E
    "q_groups": (P("data", None), P("data", None, None)),     # FSDP within blocks
    "gate_up": (P("data", None), P("data", None, None)),      # tall blocks, FSDP
    "both": (P("model", "data"), P("model", None, None, None)),   # gathered

    "scan_q": (P(None, None, "model"), P(None, None, "model", None)),  # not over data
    "whole": (P("data", "model"), P("data", "model")),
}


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_mesh_form_equals_the_rule_on_the_reshaped_leaf(reference, axis_type):
    shapes, _, _ = trees(True)
    mesh = jax.make_mesh((4, 2), DM, axis_types=(axis_type,) * 2)

    def specs(blocked):
        return {k: MESH_SPECS[k][0 if blocked else 1] if k in MESH_SPECS else P()
                for k in shapes}

    def put(tree, blocked):
        return {k: jax.device_put(x, NamedSharding(mesh, specs(blocked)[k]))
                for k, x in tree.items()}

    def make_step(tx, params):
        step = jax.jit(lambda p, s, g: _apply(tx, p, s, g), compiler_options=sp.FAST_COMPILE)
        return jax.jit(tx.init), step

    kw = dict(axis_name=DM, mesh=mesh)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        tx = make_tx(True, param_specs=specs(True), **kw)
        kinds = {m: s["transport"] for s in tx.init.stack_info(put(values(0, shapes), True))
                 for m in s["members"]}
    assert {str(w.message).split("'")[1] for w in caught} == {"scan_q", "both"}
    local = ("q_heads", "qkv_heads", "proj_heads", "pt_q_heads", "mha_q", "experts")
    assert {k: kinds[k] for k in local} == dict.fromkeys(local, "local")
    assert kinds["q_groups"] == kinds["gate_up"] == "exchange"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = run(True, STEPS, make_step, put, param_specs=specs(True), **kw)
        want = run(False, STEPS, make_step, put, param_specs=specs(False), **kw)
    assert_same_steps(got, want, values(0, shapes))
    assert_same_steps(got, reference, values(0, shapes), tol=1e-5)


# ------------------------------------------------------------------ head parallel: no traffic


def place(tree, specs, mesh):
    return {k: jax.device_put(x, NamedSharding(mesh, specs.get(k, P())))
            for k, x in tree.items()}


def head_parallel(n: int, axis_type):
    """Per-head c_q / c_proj and 2 heads per block of a fused QKV, split over ``n``
    devices on block boundaries, and experts split on E: every device holds whole
    blocks."""
    heads, hd, w = 2 * n, 16, 64
    shapes = {"c_q": (w, heads * hd), "c_proj": (heads * hd, w), "qkv": (w, 3 * heads * hd),
              "experts": (n, w, 2 * w)}
    dims = {"c_q": D(0, 1, output_blocks=heads), "c_proj": D(0, 1, reduction_blocks=heads),
            "qkv": D(0, 1, output_blocks=3 * heads // 2), "experts": D(1, 2)}
    specs = {"c_q": P(None, "model"), "c_proj": P("model", None), "qkv": P(None, "model"),
             "experts": P("model")}
    mesh = jax.make_mesh((n,), ("model",), axis_types=(axis_type,),
                         devices=jax.devices()[:n])
    labels = dict.fromkeys(shapes, "muon")
    groups = {"muon": GROUPS["muon"]}
    tx = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims, axis_name="model",
                               mesh=mesh, param_specs=specs)
    single = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims)
    params = place(values(0, shapes), specs, mesh)
    return tx, single, params, shapes, mesh


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
@pytest.mark.parametrize("axis_type", [AxisType.Explicit, AxisType.Auto],
                         ids=["explicit", "auto"])
def test_head_parallel_blocks_need_no_collective(axis_type):
    n = 8
    tx, single, params, shapes, mesh = head_parallel(n, axis_type)
    state = jax.jit(tx.init)(params)
    # One jitted step each, lowered here and then run below: the runs reuse these compiles.
    step = jax.jit(lambda p, s, g: _apply(tx, p, s, g))
    step1 = jax.jit(lambda p, s, g: _apply(single, p, s, g))
    compiled = step.lower(params, state, params).compile()
    assert sp.collectives(compiled.as_text(), n) == {}
    # Each device computes its own blocks: 1/n of the one-device program's FLOPs.
    plain = {k: np.asarray(x) for k, x in params.items()}
    one = step1.lower(plain, single.init(plain), plain).compile()
    flops = compiled.cost_analysis()["flops"] / one.cost_analysis()["flops"]
    assert 0.9 / n <= flops <= 1.1 / n, flops
    est = muon_optax.estimate(tx, jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape,
                                                                              x.dtype), params),
                              n, param_specs={"c_q": P(None, "model"), "c_proj": P("model"),
                                              "qkv": P(None, "model"), "experts": P("model")})
    assert est["collective_bytes"] == [0.0] * n
    members = {m["path"]: m for s in est["stacks"] for m in s["members"]}
    assert members["c_q"]["blocks"] == (2 * n, 1) and members["c_proj"]["blocks"] == (1, 2 * n)
    # And the steps are the one-device steps.
    state1, p, p1 = single.init(plain), params, plain
    for s in range(2):
        g = values(s + 1, shapes)
        p, state = step(p, state, place(g, {k: x.sharding.spec for k, x in params.items()},
                                        mesh))
        p1, state1 = step1(p1, state1, g)
    for k in shapes:
        np.testing.assert_allclose(np.asarray(p[k]), np.asarray(p1[k]), rtol=0, atol=2e-6)


# ------------------------------------------------------------------ ownership per block


@pytest.mark.parametrize("depth", [12, 20])
def test_blocks_balance_within_5_percent_of_the_exact_optimum(depth):
    """Per-head attention blocks (head_dim 128) beside whole MLP matrices, up to 256
    devices: the busiest device's Muon FLOPs and state within 5% of the exact optimum of
    each, the bound whole matrices meet (tests/test_plan.py)."""
    groups = {"matrix": dict(kind="muon", lr=0.02)}
    heads = depth // 2
    params = nanochat_blocks(depth)

    def dims(path, x):
        name = muon_optax.path_str(path)
        if "attn" not in name:
            return None
        return D(0, 1, **({"reduction_blocks": heads} if name.endswith("c_proj")
                          else {"output_blocks": heads}))

    tx = muon_optax.muon_adamw(groups, lambda p: jax.tree.map(lambda _: "matrix", p),
                               dimension_numbers=jax.tree_util.tree_map_with_path(dims, params),
                               axis_name="data")
    for n in (8, 16, 32, 64, 128, 256):
        counts = [k for _, k, _, _ in stack_costs(tx, params, n)]
        assert counts == [2 * depth, 4 * heads * depth]
        flops, state = busiest_over_optimum(tx, params, n)
        assert flops <= 1.05 and state <= 1.05, (n, flops, state)


# ------------------------------------------------------------------ errors


@pytest.mark.parametrize("dims, message", [
    (D(0, 1, output_blocks=5), "output_blocks=5 does not divide its side of 32"),
    (D(0, 1, reduction_blocks=3), "reduction_blocks=3 does not divide its side of 32"),
    (D(0, 1, output_blocks=0), "output_blocks must be a positive int"),
    (D(0, 1, output_blocks=2.0), "output_blocks must be a positive int"),
])
def test_a_count_that_does_not_divide_is_a_clear_error(dims, message):
    params = {"attn": {"c_q": np.zeros((32, 32), np.float32)}}
    tx = muon_optax.muon(0.02, dimension_numbers={"attn": {"c_q": dims}})
    with pytest.raises(ValueError, match=message) as e:
        tx.init(params)
    assert "'attn/c_q'" in str(e.value)


def test_blocks_that_cut_a_multi_axis_side_unevenly_are_refused():
    params = {"k": np.zeros((8, 3, 4), np.float32)}
    tx = muon_optax.muon(0.02, dimension_numbers={"k": D(0, (1, 2), output_blocks=2)})
    with pytest.raises(ValueError, match="cuts axis 1 .size 3. .* unevenly"):
        tx.init(params)


def test_optax_dimension_numbers_are_one_block():
    params = {"w": np.ones((8, 16), np.float32)}
    ours = muon_optax.muon(0.02, dimension_numbers={"w": D(1, 0)})
    theirs = muon_optax.muon(0.02, dimension_numbers={
        "w": optax.contrib.MuonDimensionNumbers(1, 0)})
    g = {"w": np.arange(128, dtype=np.float32).reshape(8, 16) / 100}
    a, _ = ours.update(g, ours.init(params), params)
    b, _ = theirs.update(g, theirs.init(params), params)
    np.testing.assert_array_equal(np.asarray(a["w"]), np.asarray(b["w"]))


def test_contrib_muon_takes_blocks_too():
    """optax.contrib.muon's rule (contrib_muon) on blocks: the rule on the reshaped leaf."""
    rng = np.random.default_rng(0)
    w = rng.standard_normal((W, W)).astype(np.float32)
    g = rng.standard_normal((W, W)).astype(np.float32)
    tx = muon_optax.contrib_muon(0.02, muon_weight_dimension_numbers={
        "w": D(0, 1, output_blocks=H)})
    ref = muon_optax.contrib_muon(0.02, muon_weight_dimension_numbers={"w": D(0, 2)})
    got, _ = tx.update({"w": g}, tx.init({"w": w}), {"w": w})
    r = {"w": w.reshape(W, H, HD)}
    want, _ = ref.update({"w": g.reshape(W, H, HD)}, ref.init(r), r)
    np.testing.assert_allclose(np.asarray(got["w"]), np.asarray(want["w"]).reshape(W, W),
                               rtol=1e-6, atol=1e-7)


# ------------------------------------------------------------------ as the README calls it


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_zero2_with_jax_grad_inside_shard_map_equals_one_device():
    """The README's ZeRO-2 recipe with per-head blocks (w1 on its output side, w2 on its
    input side): each device's jax.grad at pcast(params), tx.update inside shard_map; the
    steps equal one device's on the global batch."""
    n = 8
    params, groups, labels = sp.tiny_lm()
    dims = {"embed": None, "gain": None, "w1": D(0, 1, output_blocks=4),
            "w2": D(0, 1, reduction_blocks=4)}
    mesh = sp.make_mesh((n,))
    tx = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims, axis_name="data")
    single = muon_optax.muon_adamw(groups, labels, dimension_numbers=dims)
    specs = muon_optax.state_specs(tx, params, mesh)

    def train_step(params, state, tokens):
        grads = jax.grad(sp.tiny_lm_loss)(jax.lax.pcast(params, "data", to="varying"), tokens)
        updates, state = tx.update(grads, state, params)
        return optax.apply_updates(params, updates), state

    @jax.jit
    def step1(params, state, tokens):
        updates, state = single.update(jax.grad(sp.tiny_lm_loss)(params, tokens), state, params)
        return optax.apply_updates(params, updates), state

    step = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, P("data")),
                                 out_specs=(P(), specs)))
    state = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))(params)
    p, p1, state1, got, want = params, params, single.init(params), [], []
    for s in range(STEPS):
        tokens = jax.random.randint(jax.random.PRNGKey(s), (4 * n, 8), 0, 64)
        p, state = step(p, state, tokens)
        p1, state1 = step1(p1, state1, tokens)
        got.append(p)
        want.append(p1)
    assert_same_steps(got, want, params, tol=1e-5)


def _nnx_run(g, nnx, blocked: bool, mesh=None):
    """Flax's standard modules through nnx.Optimizer, 3 steps: ``(params, model,
    optimizer, tx)``."""
    model = g.GPT(nnx.Rngs(0))
    kw = {} if mesh is None else dict(axis_name="data", mesh=mesh)
    if mesh is not None:
        g.place(model, mesh)
    tx = g.make_tx(dimension_numbers=g.attention_dims(g.HEADS, blocked), **kw)
    opt = nnx.Optimizer(model, tx, wrt=nnx.Param)
    for s in range(STEPS):
        g.train_step(model, opt, g.tokens(seed=s % 2))
    return _by_path(nnx, model), model, opt, tx


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")
def test_nnx_optimizer_with_head_blocks_on_one_device_and_an_auto_mesh():
    """Per-head blocks of Flax's attention kernels through nnx.Optimizer: on one device
    the steps of the heads-as-batch reference; on an Auto mesh with FSDP-placed params
    (learned by the eager init) two all-to-alls and the one-device steps."""
    pytest.importorskip("flax")
    import nnx_gpt as g
    from flax import nnx

    start = _by_path(nnx, g.GPT(nnx.Rngs(0)))
    got = _nnx_run(g, nnx, blocked=True)[0]
    want = _nnx_run(g, nnx, blocked=False)[0]
    assert_same_steps([got], [want], start)
    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Auto,))
    with jax.set_mesh(mesh):
        sharded, model, opt, tx = _nnx_run(g, nnx, blocked=True, mesh=mesh)
        ops = g.optimizer_collectives(tx, opt, model, 8)
    assert set(ops) == {"all-to-all"} and ops["all-to-all"]["count"] == 2, ops
    assert_same_steps([sharded], [got], start, tol=1e-5)


def _by_path(nnx, model) -> dict:
    """The model's params as NumPy, by path, without the attention's key biases: softmax
    does not see them, so their gradient is rounding noise that Adam scales up to full
    steps."""
    flat = jax.tree_util.tree_flatten_with_path(nnx.as_pure(nnx.state(model, nnx.Param)))[0]
    return {muon_optax.path_str(p): np.asarray(x) for p, x in flat
            if not muon_optax.path_str(p).endswith("key/bias")}
