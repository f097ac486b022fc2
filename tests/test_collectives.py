"""The gradients' reduce-scatter by rows (ZeRO-2's Muon share): the pieces TPU sends
equal the whole reduce-scatter other platforms run, element by element, and on XLA:CPU
the step still sends one reduce-scatter."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from muon_optax.step.collectives import Collectives, row_slice

try:
    from . import sharded_problem as sp
except ImportError:
    import sharded_problem as sp

pytestmark = pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices")

N = 8
# Per destination row: the sizes of the parts each device sends it (uneven, one empty
# row, parts longer than a piece), and the padded row length.
PARTS = [[5, 9], [14], [3, 3, 3], [], [1, 12], [7], [13], [2, 2, 2, 2]]
LENGTH = 16


def _rows(flat: jax.Array) -> list[list[jax.Array]]:
    rows, at = [], 0
    for sizes in PARTS:
        rows.append([flat[at + sum(sizes[:i]):at + sum(sizes[:i + 1])]
                     for i in range(len(sizes))])
        at += sum(sizes)
    return rows


def _data() -> np.ndarray:
    """Each device's contributions, whole numbers: every order of summing is exact."""
    total = sum(sum(s) for s in PARTS)
    return np.random.default_rng(0).integers(-50, 50, (N, total)).astype(np.float32)


def _expected(data: np.ndarray) -> np.ndarray:
    """Row ``d`` of every device's packed buffer, averaged over the devices."""
    packed = np.zeros((N, N, LENGTH), np.float32)   # (source, destination, column)
    at = 0
    for d, sizes in enumerate(PARTS):
        packed[:, d, :sum(sizes)] = data[:, at:at + sum(sizes)]
        at += sum(sizes)
    return packed.sum(axis=0) / N


def _run(fn, data):
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",), axis_types=(AxisType.Auto,))
    body = jax.shard_map(lambda x: fn(Collectives(("data",)), _rows(x[0]))[None],
                         mesh=mesh, in_specs=P("data"), out_specs=P("data"))
    return jax.jit(body), jax.device_put(data, NamedSharding(mesh, P("data")))


@pytest.mark.parametrize("piece", [3, 5, LENGTH, LENGTH + 7])
def test_pieces_equal_the_whole_reduce_scatter(piece):
    data = _data()
    pieces, x = _run(lambda c, rows: c._sum_exchange_pieces(rows, LENGTH, piece,
                                                             jnp.float32) / N, data)
    whole, _ = _run(lambda c, rows: c.mean_scatter_rows(rows, LENGTH, piece, jnp.float32),
                    data)
    np.testing.assert_array_equal(np.asarray(pieces(x)), _expected(data))
    np.testing.assert_array_equal(np.asarray(whole(x)), _expected(data))
    hlo = pieces.lower(x).compile().as_text()
    assert len(re.findall(r"all-to-all(?:-start)?\(", hlo)) == -(-LENGTH // piece)


def test_cpu_sends_one_reduce_scatter():
    data = _data()
    fn, x = _run(lambda c, rows: c.mean_scatter_rows(rows, LENGTH, 3, jnp.float32), data)
    hlo = fn.lower(x).compile().as_text()
    assert len(re.findall(r"reduce-scatter(?:-start)?\(", hlo)) == 1
    assert "all-to-all" not in hlo


def test_row_slice_pads_and_spans_parts():
    parts = [jnp.arange(3.0), jnp.arange(10.0, 14.0)]
    np.testing.assert_array_equal(row_slice(parts, 2, 5, jnp.float32), [2.0, 10.0, 11.0])
    np.testing.assert_array_equal(row_slice(parts, 6, 9, jnp.float32), [13.0, 0.0, 0.0])
    np.testing.assert_array_equal(row_slice([], 0, 2, jnp.float32), [0.0, 0.0])


# ----------------------------------------------------------------------------- the gather back


@pytest.mark.parametrize("form, size", [("pieces", 7), ("pieces", 200), ("pieces", 10**6),
                                        ("groups", 1), ("groups", 3), ("groups", 8)])
def test_directions_gathered_in_parts_equal_the_whole_gather(form, size):
    """ZeRO-2's directions on TPU, gathered in column pieces of ``size`` elements, or (past 32
    devices) as the rows of ``size`` devices at a time summed with the others' zeros (each sum
    completing those devices' matrices): the same leaves as one all-gather, bit for bit,
    matrices cut across pieces and a scanned leaf's matrices on several devices included; one
    all-gather per piece, one all-reduce (and no all-gather) per group."""
    import muon_optax
    from muon_optax.step.transport import GatherSink

    params = sp.make_params()
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, axis_name="data")
    owner = tx.init.plan(params, N).owner
    (dtype,) = owner.gather
    length = owner.gather[dtype].length
    data = np.random.default_rng(1).standard_normal((N, length)).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",), axis_types=(AxisType.Auto,))

    def run(form):
        def body(x):
            sink = GatherSink(owner, dtype, Collectives(("data",)))
            return form(sink, x[0])
        fn = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("data"), out_specs=P()))
        x = jax.device_put(data, NamedSharding(mesh, P("data")))
        return fn(x), fn.lower(x).compile().as_text()

    whole, _ = run(lambda sink, b: sink._whole(b))
    parts, hlo = run(lambda sink, b: getattr(sink, f"_by_{form}")(b, size))
    assert sorted(whole) == sorted(parts) and len(whole) == 7
    for i in whole:
        np.testing.assert_array_equal(np.asarray(parts[i]), np.asarray(whole[i]))
    gathers = len(re.findall(r"all-gather(?:-start)?\(", hlo))
    if form == "pieces":
        assert gathers == -(-length // size)
    else:
        assert len(re.findall(r"all-reduce(?:-start)?\(", hlo)) == -(-N // size) and not gathers


# ------------------------------------------------------------------ the exchange transport


def _fsdp_step(monkeypatch, width, barriers=False):
    """Two FSDP (mesh=) steps on 4 devices and the compiled step's text; ``width``: the
    exchange transport forced into column pieces of that many elements (as on TPU), or
    None for the form XLA:CPU lowers; ``barriers``: the pieces ordered by the TPU's
    optimization barriers, which XLA:CPU drops (the values are what is compared then,
    not the schedule)."""

    import muon_optax
    from muon_optax.rule import platform
    from muon_optax.step import exchange

    if width is not None:   # every transport in its TPU form (FSDP's gather stacks too)
        for site in ("exchange", "gather") + (("order",) if barriers else ()):
            monkeypatch.setitem(platform.FORCED, site, "tpu")
        monkeypatch.setattr(exchange, "exchange_piece", lambda owner: width)
    n = 4
    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,),
                         devices=jax.devices()[:n])
    params = sp.make_params()
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS,
                               axis_name="data", mesh=mesh)
    out, step, args = sp.jit_steps(tx, mesh, sp.fsdp_specs(params, n), n)
    return ([p for p, _ in out], step.lower(*args).compile().as_text(),
            tx.init.plan(args[0]).owner)


@pytest.mark.parametrize("width", [7, 10**6])
def test_exchange_in_pieces_equals_the_whole_exchange(monkeypatch, width):
    """FSDP's exchange transport in column pieces (TPU, ordered by arithmetic or by the
    TPU's barriers) or at once (XLA:CPU): the same steps, bit for bit, with matrices cut
    across pieces; the CPU form sends one all-to-all each way, the pieces one per piece."""
    whole, hlo, owner = _fsdp_step(monkeypatch, None)
    assert len(owner.exchange) == 1 and any(sp.transport == "exchange" for sp in owner.stacks)
    assert len(re.findall(r"all-to-all(?:-start)?\(", hlo)) == 2
    with monkeypatch.context() as m:
        pieces, hlo, _ = _fsdp_step(m, width)
    with monkeypatch.context() as m:
        ordered, _, _ = _fsdp_step(m, width, barriers=True)
    for a, b, c in zip(jax.tree.leaves(whole), jax.tree.leaves(pieces),
                       jax.tree.leaves(ordered)):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)
    (ch,), (back,) = owner.exchange.values(), owner.back.values()
    assert len(re.findall(r"all-to-all(?:-start)?\(", hlo)) == (
        -(-ch.length // width) + -(-back.length // width))


def test_scatter_pieces_narrow_with_more_devices(monkeypatch):
    """A piece of every device's row holds half a largest Muon matrix a device up to
    ``2 * PIECE_MATRICES`` devices and ``PIECE_MATRICES`` matrices in all beyond (on a
    64-chip v5p a row is about one largest matrix: whole-row pieces were the whole buffer),
    but ``PIECE_ELEMENTS`` at least (this tiny model's rows: one piece on any device count)."""
    import muon_optax
    from muon_optax.step import transport

    params = sp.make_params()
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, axis_name="data")
    owners = {n: tx.init.plan(params, n).owner for n in (4, 8, 16, 64)}
    for n, owner in owners.items():
        assert transport.scatter_piece(owner) == transport.PIECE_ELEMENTS // n
        assert all(transport.scatter_piece(owner) >= ch.length for ch in owner.gather.values())
    monkeypatch.setattr(transport, "PIECE_ELEMENTS", 0)
    pieces = {}
    for n, owner in owners.items():
        largest = max(s.stack.rows * s.stack.cols for s in owner.stacks)
        pieces[n] = transport.scatter_piece(owner)
        assert pieces[n] * n <= transport.PIECE_MATRICES * largest
    assert pieces[4] == pieces[8] == pieces[16] == largest // 2
    assert pieces[64] == largest // 8


@pytest.mark.parametrize("shape, axis, budget, pieces", [
    ((16, 300), 0, 16 * 100 * 4, 3),    # cut along axis 1 in widths of 128: 128, 128, 44
    ((40, 16), 1, 16 * 16 * 4, 3),      # cut along axis 0 (shorter than 128): 14, 14, 12
    ((16, 300), 0, 16 * 300 * 4, 1),    # within the budget: one all-to-all
])
def test_large_reduce_scatter_in_pieces_equals_psum_scatter(shape, axis, budget, pieces):
    """An AdamW gradient's reduce-scatter as TPU sends it (all-to-alls and sums, in
    pieces cut along another axis) equals ``psum_scatter``, element by element."""
    data = np.random.default_rng(2).integers(-50, 50, (N,) + shape).astype(np.float32)
    mesh = Mesh(np.array(jax.devices()[:N]), ("data",), axis_types=(AxisType.Auto,))
    x = jax.device_put(data, NamedSharding(mesh, P("data")))

    def run(form):
        body = jax.shard_map(lambda g: form(Collectives(("data",)), g[0])[None], mesh=mesh,
                             in_specs=P("data"), out_specs=P("data"))
        return jax.jit(body)

    split = run(lambda c, g: c._sum_scatter_by_exchange_pieces(g, axis, budget))
    whole = run(lambda c, g: c._sum_scatter(axis)(g))
    np.testing.assert_array_equal(np.asarray(split(x)), np.asarray(whole(x)))
    hlo = split.lower(x).compile().as_text()
    assert len(re.findall(r"all-to-all(?:-start)?\(", hlo)) == pieces


def _entry_deps(hlo: str) -> dict[str, tuple[str, set[str]]]:
    """The entry computation of an optimized HLO text: per instruction, its opcode and
    the instructions it reads."""
    entry = hlo[hlo.index("\nENTRY"):]
    entry = entry[:entry.index("\n}")]
    out = {}
    for line in entry.splitlines()[1:]:
        m = re.match(r"\s*(?:ROOT )?%?([\w.\-]+) = .*?\b([a-z][\w\-]*)\((.*)$", line)
        if m:
            out[m.group(1)] = (m.group(2), set(re.findall(r"%([\w.\-]+)", m.group(3))))
    return out


def test_exchange_pieces_wait_for_the_stacks_before(monkeypatch):
    """On TPU a piece of the forward exchange is sent just before the load that first
    reads it: some forward all-to-alls wait for an earlier stack's polar loop (before,
    every piece was received before the first stack ran)."""
    width = 7
    _, hlo, owner = _fsdp_step(monkeypatch, width)
    deps = _entry_deps(hlo)

    def waits_for_loop(name, seen):
        for d in deps.get(name, ("", ()))[1]:
            if d not in seen:
                seen.add(d)
                if deps.get(d, ("",))[0] in ("while", "conditional") or waits_for_loop(d, seen):
                    return True
        return False

    exchanges = [n for n, (op, _) in deps.items() if op in ("all-to-all", "all-to-all-start")]
    (ch,) = owner.exchange.values()
    forward = -(-ch.length // width)
    assert len(exchanges) > forward
    free = [n for n in exchanges if not waits_for_loop(n, set())]
    assert 0 < len(free) < forward


def test_directions_sent_back_as_their_stacks_finish(monkeypatch):
    """On TPU a piece of the directions goes back as soon as the stores that can write
    it are done, before later stacks run: fewer all-to-alls than the back channel's
    pieces are left for after the last Muon kernel (before, every piece waited for the
    last store)."""
    width = 7
    _, hlo, owner = _fsdp_step(monkeypatch, width)
    deps = _entry_deps(hlo)
    users: dict[str, set[str]] = {}
    for name, (_, reads) in deps.items():
        for r in reads:
            users.setdefault(r, set()).add(name)

    def feeds_loop(name, seen):
        for u in users.get(name, ()):
            if u not in seen:
                seen.add(u)
                if deps[u][0] in ("while", "conditional") or feeds_loop(u, seen):
                    return True
        return False

    exchanges = [n for n, (op, _) in deps.items() if op in ("all-to-all", "all-to-all-start")]
    (back,) = owner.back.values()
    after_last = [n for n in exchanges if not feeds_loop(n, set())]
    assert 0 < len(after_last) < -(-back.length // width)


def _two_steps(contender: str, forced: tuple[str, ...], monkeypatch, n: int = 4,
               layers: int = 4, chunk: int = 1):
    """Two steps of ``tpu_compile.build``'s ``contender`` on ``n`` devices, a model of
    whole (8, 128) tiles (nanochat's shapes at width 128, ``layers`` layers), every
    device fed the same gradient, with ``forced`` sites in their TPU form, and chunks of
    ``chunk`` (128, 128) matrices (one: in the TPU form the attention stack's slots run
    in a loop); the new params and state (unowned slots' state included), and the
    lowered program."""
    import muon_optax
    from benchmarks import common, tpu_compile
    from muon_optax.rule import platform
    from muon_optax.step import matrices

    for site in forced:
        monkeypatch.setitem(platform.FORCED, site, "tpu")
    monkeypatch.setattr(matrices, "chunk_bytes", lambda plan: chunk * 4 * 128 * 128)
    params = common.nanochat_params(128, layers, 256)
    grads = common.random_grads(params)
    fn, (p_abs, s_abs, g_abs), tx, _ = tpu_compile.build(contender, params, jax.devices()[:n])

    def put(tree, like):
        return jax.tree.map(lambda x, a: jax.device_put(
            np.broadcast_to(x, a.shape), a.sharding), tree, like)

    p = put(params, p_abs)
    if contender == "zero2":
        mesh = jax.tree.leaves(p_abs)[0].sharding.mesh
        init = jax.shard_map(tx.init, mesh=mesh, in_specs=P(),
                             out_specs=muon_optax.state_specs(tx, params, mesh))
    else:
        init = tx.init
    s = jax.jit(init, out_shardings=jax.tree.map(lambda a: a.sharding, s_abs))(p)
    hlo = fn.lower(p, s, put(grads, g_abs)).as_text()
    for _ in range(2):
        p, s = fn(p, s, put(grads, g_abs))
    return jax.tree.leaves((p, s)), hlo


@pytest.fixture(scope="module")
def zero2_cpu_form_on_8():
    """Two steps of ZeRO-2's CPU form on 8 devices: what every group size is compared
    with (one build and compile, not one for each)."""
    with pytest.MonkeyPatch.context() as m:
        return _two_steps("zero2", (), m, n=8)[0]


@pytest.mark.parametrize("group", [8, 2])
def test_zero2_tpu_form_past_the_all_gather_limit(monkeypatch, group, zero2_cpu_form_on_8):
    """Where the TPU compiler makes an all-gather an all-reduce (64 v5p chips; here on 8
    devices, the limit lowered to 4): the directions come back by device groups (one of 8, or
    four of 2: a device outside a group sends it zeros) and the AdamW updates are gathered
    flat (every all-gather 1-D). Two steps equal the CPU form's to rounding."""
    from muon_optax.step import transport

    want = zero2_cpu_form_on_8
    with monkeypatch.context() as m:
        groups = sp.lower_all_gather_limit(m, 4)
        m.setattr(transport, "PIECE_MATRICES", group)
        m.setattr(transport, "PIECE_ELEMENTS", 0)   # the tiny model's rows: no floor
        got, hlo = _two_steps("zero2", sp.TPU_SITES, m, n=8)
    assert groups == [group]
    gathers = [line for line in hlo.splitlines() if '"stablehlo.all_gather"' in line]
    assert gathers and all(re.search(r": \(tensor<\d+xf32>\) -> tensor<\d+xf32>$", line)
                           for line in gathers), gathers
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def _skips(m) -> list:
    """Counts the ``cond`` branches built for slots a device may not own (``_skipped``)."""
    from muon_optax.step import sharded

    calls, real = [], sharded._skipped
    m.setattr(sharded, "_skipped", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("contender", ["zero2", "fsdp", "heads_tp"])
def test_tpu_forms_with_tiled_buffers_and_loops_equal_the_cpu_form(monkeypatch, contender):
    """Every transport in its TPU form (pieces, barriers), with its buffers in the TPU's
    tile order, and equal chunks of a stack in a loop, forced on XLA:CPU: the same steps
    as the CPU form, bit for bit (every buffer is read back in the order it was written
    in; the loop runs the same kernel on the same chunks)."""
    sites = ("exchange", "gather", "scatter", "order", "late_adamw", "remainder")
    with monkeypatch.context() as m:
        want, cpu_hlo = _two_steps(contender, (), m)
    with monkeypatch.context() as m:
        rows, rows_hlo = _two_steps(contender, sites, m)
    with monkeypatch.context() as m:
        tiles, tiles_hlo = _two_steps(contender, sites + ("tiles", "loop"), m)
    assert tiles_hlo != rows_hlo           # the tile order is taken
    loops = [h.count("stablehlo.while") for h in (cpu_hlo, rows_hlo, tiles_hlo)]
    if contender in ("fsdp", "heads_tp"):   # exchange and local stacks: chunk by chunk, no
        assert loops[2] == loops[1] == loops[0], loops   # loop (sharded._unlooped_runs)
    else:   # and the chunks in a loop: one kernel (one polar loop) where the other forms
        # have one for each chunk
        assert loops[2] < loops[1] == loops[0], loops
    for a, b, c in zip(want, rows, tiles):
        np.testing.assert_array_equal(a, b)
        np.testing.assert_array_equal(a, c)


@pytest.mark.parametrize("contender,n,layers", [("zero2", 3, 4), ("fsdp", 4, 5)])
def test_tpu_form_runs_a_slot_some_devices_do_not_own_in_a_loop(monkeypatch, contender, n,
                                                                  layers):
    """A stack whose last chunk is a lone matrix and that has a slot some devices do not
    own (on 3 devices 16 attention matrices, 5 each and one more on one device; 4 MLP
    matrices of a shape, 1 and one more; on 4 devices 10 MLP matrices, c_proj stored
    wide in c_fc's stack, 2 and one more).
    The CPU form skips that slot under a ``cond`` where not owned; the TPU form runs it
    in a loop with the chunk, its state and direction kept as they were where not owned
    (ZeRO-2). FSDP's exchange stacks never loop (``sharded._unlooped_runs``): that slot
    runs on its own, masked the same way (no ``cond`` on TPU).
    The same steps, the unowned slots' state included, to rounding: XLA:CPU fuses the
    kernel inside a ``cond`` otherwise (1.5e-8 apart in the params after two steps; an
    unmasked state is 0.1 off)."""
    sites = sp.TPU_SITES
    with monkeypatch.context() as m:
        cpu_skips = _skips(m)
        want, cpu_hlo = _two_steps(contender, (), m, n=n, layers=layers)
    with monkeypatch.context() as m:
        tpu_skips = _skips(m)
        got, tpu_hlo = _two_steps(contender, sites, m, n=n, layers=layers)
    conds = [h.count("stablehlo.case") + h.count("stablehlo.if") for h in (cpu_hlo, tpu_hlo)]
    assert conds[1] < conds[0] and cpu_skips and not tpu_skips, conds
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_tpu_form_cuts_a_stack_into_equal_chunks_a_little_over_the_budget():
    """On TPU a stack's slots every device owns go in equal chunks, so that one kernel
    runs them all: chunks as equal as their count allows (6 slots at 4 a chunk: 3 and
    3), else a divisor of the slots up to half as large again as the budget's chunk (10
    at 4: 5 and 5, not 4, 4 and 2), else as before (7 at 4: 4 and 3). Elsewhere chunks
    of the budget. An exchange stack (FSDP) on TPU over 1.5 budgets: chunks of the
    largest divisor up to the budget's, each a run of its own (no loop); within: as
    any other stack."""
    from types import SimpleNamespace

    from muon_optax.step import matrices, sharded

    def runs(base, cap, loop, transport="gather"):
        sp = SimpleNamespace(base=base, num_slots=base, transport=transport,
                             stack=SimpleNamespace(rows=8, cols=8))
        matrix = 4 * 8 * 8
        with pytest.MonkeyPatch.context() as m:
            m.setattr(matrices, "chunk_bytes", lambda plan: cap * matrix)
            return sharded._runs(sp, None, 4 * cap * matrix if loop else 0)

    assert runs(6, 4, True) == [[(0, 3), (3, 6)]]
    assert runs(10, 4, True) == [[(0, 5), (5, 10)]]
    assert runs(5, 4, True) == [[(0, 5)]]
    assert runs(7, 4, True) == [[(0, 4)], [(4, 7)]]
    assert runs(10, 4, False) == [[(0, 4)], [(4, 8)], [(8, 10)]]
    assert runs(10, 4, True, "exchange") == [[(0, 2)], [(2, 4)], [(4, 6)], [(6, 8)], [(8, 10)]]
    assert runs(7, 4, True, "exchange") == [[(j, j + 1)] for j in range(7)]
    assert runs(6, 4, True, "exchange") == [[(0, 3), (3, 6)]]
    assert runs(5, 1, True, "exchange") == [[(j, j + 1)] for j in range(5)]
    assert runs(10, 4, False, "exchange") == [[(0, 4)], [(4, 8)], [(8, 10)]]


@pytest.mark.parametrize("contender,layers,chunk,want_loops", [
    ("zero2", 10, 4, [(128, 128, 10, 5), (128, 512, 2, 1)]),
    ("fsdp", 11, 2, [])])
def test_tpu_form_with_chunks_over_the_budget_and_a_slot_in_a_cond(monkeypatch, contender,
                                                                    layers, chunk, want_loops):
    """On 4 devices. ZeRO-2, 10 layers, chunks of 4: 10 attention matrices a device, in
    chunks of 5 on TPU where the CPU form has 4, 4 and 2; the MLP's 10 matrices of a shape,
    2 in a loop and one more on half the devices (under a ``cond`` on CPU; on TPU run by
    every device, its state kept where not owned). FSDP (c_proj stored wide, in c_fc's
    stack: its 22 MLP matrices balance against the attention's), 11 layers, chunks of 2: 6
    attention matrices a device in chunks of 2, no loop (an exchange stack's chunks are
    never over the budget: ``sharded._unlooped_runs``), the rest one by one. The same steps
    as the CPU form, to rounding (the kernel inside a ``cond`` fuses otherwise)."""
    from muon_optax.step import matrices

    sites = sp.TPU_SITES
    with monkeypatch.context() as m:
        cpu_skips = _skips(m)
        want, cpu_hlo = _two_steps(contender, (), m, layers=layers, chunk=chunk)
    loops, kernel_in_loop = [], matrices.kernel_in_loop

    def spy(stack, g_all, per, *args):
        loops.append((stack.rows, stack.cols, g_all.shape[0], per))
        return kernel_in_loop(stack, g_all, per, *args)

    with monkeypatch.context() as m:
        m.setattr(matrices, "kernel_in_loop", spy)
        tpu_skips = _skips(m)
        got, tpu_hlo = _two_steps(contender, sites, m, layers=layers, chunk=chunk)
    assert all(loop in loops for loop in want_loops) and bool(loops) == bool(want_loops), loops
    assert cpu_skips and not tpu_skips
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("contender", ["zero2", "fsdp"])
def test_tpu_form_runs_stacks_of_fewer_matrices_than_devices_masked(monkeypatch, contender):
    """One layer on 8 devices: 4 attention matrices and 2 MLP ones, so no slot is owned by
    every device. The CPU form skips each under a ``cond`` where not owned; on TPU every
    device runs it and keeps the owner's state (a ``cond`` holds its operands and results
    at once: FSDP d1280x20 on 64 v5p chips, 296.3 MiB of temporaries against 179.5). The
    same steps, the unowned slots' state included, to rounding."""
    sites = sp.TPU_SITES
    with monkeypatch.context() as m:
        cpu_skips = _skips(m)
        want, _ = _two_steps(contender, (), m, n=8, layers=1)
    with monkeypatch.context() as m:
        tpu_skips = _skips(m)
        got, _ = _two_steps(contender, sites, m, n=8, layers=1)
    stacks = {"zero2": 3, "fsdp": 2}[contender]   # FSDP: c_proj in c_fc's stack
    assert len(cpu_skips) >= stacks and not tpu_skips   # (a slot of each)
    for a, b in zip(want, got):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
