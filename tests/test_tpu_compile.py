"""The step as the TPU compiler builds it, for compile-only devices of a small TPU slice.

With ``libtpu`` installed (``pip install -e ".[tpu]"``; CI's newest leg installs it in a
venv of its own and runs only this module), ``jax.experimental.topologies`` gives the
devices of a v5p slice without a TPU, and ``.lower(...).compile()`` runs the real TPU
compiler. A tiny GPT's optimizer step compiles in every mode with the collectives the
design promises and the polar iteration as a loop; the main job's ``--aot`` dry run
compiles its whole train step in each of its modes and touches nothing. Without libtpu
these tests are skipped, but for the one line ``--aot`` answers then.

The tests' conftest asks XLA for 8 CPU devices; the TPU devices are another platform's
and come on top.
"""

import importlib.util
import math
import os
import re
import sys
from pathlib import Path

import pytest

# libtpu probes for a TPU host when it loads unless told where it is (5 s and a trace).
for _key, _value in {"ALLOW_MULTIPLE_LIBTPU_LOAD": "1", "TPU_ACCELERATOR_TYPE": "v5p-8",
                     "TPU_WORKER_HOSTNAMES": "localhost"}.items():
    os.environ.setdefault(_key, _value)

pytest.importorskip("flax")
pytest.importorskip("tqdm")

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "gpt"
for path in (EXAMPLE, REPO):  # the example's modules; benchmarks.tpu_compile
    if str(path) not in sys.path:
        sys.path.insert(0, str(path))

import train  # noqa: E402

HAS_LIBTPU = importlib.util.find_spec("libtpu") is not None
needs_libtpu = pytest.mark.skipif(not HAS_LIBTPU, reason='libtpu is not installed (pip install '
                                  '-e ".[tpu]", Python 3.12+): no TPU compiler to run')
TINY = ["--depth", "1", "--seq-len", "32", "--batch-size", "4", "--no-progress"]


@pytest.fixture(scope="module", autouse=True)
def no_compilation_cache():
    """Compile-only programs cannot be read back from the suite's compilation cache
    (conftest; jax warns, then compiles again): this module compiles without it."""
    import jax

    was = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)
    yield
    jax.config.update("jax_enable_compilation_cache", was)


@pytest.fixture(scope="module")
def chips():
    """The 4 chips of a v5p 2x2x1 slice, compile-only."""
    from jax.experimental import topologies

    return list(topologies.get_topology_desc(topology_name="v5p:2x2x1", platform="tpu").devices)



# ----------------------------------------------------------------------------- optimizer step

WIDTH, VOCAB = 256, 512   # 4 heads of 64: two per chip of the "model" axis under heads_tp


def compile_step(contender: str, devices):
    """``(params, optimized HLO, collectives)`` of ``benchmarks.tpu_compile``'s contender."""
    from benchmarks import common, tpu_compile

    params = common.nanochat_params(WIDTH, 1, VOCAB, abstract=True)
    fn, args, _, _ = tpu_compile.build(contender, params, devices)
    hlo = fn.lower(*args).compile().as_text()
    return params, hlo, tpu_compile.loop_collectives(hlo, len(devices))


def muon_shapes(params) -> set[tuple[int, ...]]:
    """The shapes of the Muon matrices (the blocks' kernels)."""
    import jax

    return {tuple(x.shape) for path, x in jax.tree_util.tree_leaves_with_path(params)
            if "blocks" in jax.tree_util.keystr(path)}


def gathered_shapes(hlo: str) -> set[tuple[int, ...]]:
    """The result shapes of the HLO's all-gathers."""
    return {tuple(int(d) for d in dims.split(",")) for dims in
            re.findall(r"= \w+\[([\d,]+)\][^ ]* all-gather(?:-start)?\(", hlo)}


def assert_polar_loop(hlo: str) -> None:
    """The polar iteration is a while loop over its coefficient table (a (steps, 3)
    float32 carried beside a stack of matrices), not unrolled."""
    loops = [line for line in hlo.splitlines() if re.search(r"\bwhile\(", line)]
    assert any(re.search(r"f32\[\d+,3\]", line) and re.search(r"\w+\[\d+,\d+,\d+\]", line)
               for line in loops), loops


@needs_libtpu
def test_one_chip_has_no_collectives_and_loops_the_polar_iteration(chips):
    _, hlo, ops = compile_step("one_device", chips[:1])
    assert ops == {}
    assert_polar_loop(hlo)


def lowered_kernels(layers: int, chips, contender: str = "one_device") -> tuple[int, int]:
    """``(dots, while loops)`` of the step for ``layers`` blocks (one chip, or ``chips``
    for a sharded ``contender``), as lowered for the TPU (its form chosen; not compiled)."""
    from benchmarks import common, tpu_compile

    params = common.nanochat_params(64, layers, VOCAB, abstract=True)
    devices = chips[:1] if contender == "one_device" else chips
    fn, args, _, _ = tpu_compile.build(contender, params, devices)
    text = fn.lower(*args).as_text()
    return text.count("stablehlo.dot_general"), text.count("stablehlo.while")


@needs_libtpu
def test_one_chip_kernels_do_not_grow_with_layers(chips, monkeypatch):
    from muon_optax.step import one_device

    # Each stack (squares, c_fc, c_proj) has one chunk per block, in loops of up to 4
    # chunks: 2 or 4 blocks are 3 kernels, 8 blocks 6 (one per chunk: 6, 12, 24).
    dots = {n: lowered_kernels(n, chips)[0] for n in (2, 4, 8)}
    assert dots[2] == dots[4] and dots[8] == 2 * dots[4], dots
    monkeypatch.setattr(one_device, "LOOP_CHUNKS", 64)   # every stack one loop
    assert lowered_kernels(8, chips) == lowered_kernels(2, chips)


@needs_libtpu
@pytest.mark.parametrize("contender", ["fsdp", "zero2"])
def test_sharded_kernels_do_not_grow_with_layers(chips, monkeypatch, contender):
    """On 4 chips, 8 blocks give each chip two chunks of each stack where 4 blocks give
    one: on TPU equal chunks run as one kernel in a loop, so the program's kernels stay
    (with the CPU's form forced, one kernel a chunk, they double). FSDP's exchange stacks
    over 1.5 chunk budgets are stepped chunk by chunk, not looped (a loop held its run's
    matrices whole, in and out: ``sharded._unlooped_runs``), so its lowered program
    doubles too; the compiler builds the equal chunks' kernels once."""
    from muon_optax.rule import platform

    tpu = {n: lowered_kernels(n, chips, contender)[0] for n in (4, 8)}
    assert tpu[8] == (2 * tpu[4] if contender == "fsdp" else tpu[4]), tpu
    monkeypatch.setitem(platform.FORCED, "loop", "cpu")
    dots = {n: lowered_kernels(n, chips, contender)[0] for n in (4, 8)}
    assert dots[8] == 2 * dots[4], dots


@needs_libtpu
@pytest.mark.parametrize("contender", ["fsdp", "zero2"])
def test_transport_buffers_hold_matrices_as_the_tpu_lays_them_out(chips, monkeypatch,
                                                                  contender):
    """A transport's buffer holds each matrix in its tiles' order on TPU
    (``rows.flat``), so that packing and reading back a matrix is a bitcast: the
    compiled step has fewer copies (and no more kernels) than with row-major buffers."""
    from muon_optax.rule import platform

    def kernels():
        _, hlo, _ = compile_step(contender, chips)
        return len(re.findall(r" copy\(", hlo)), len(re.findall(r" fusion\(", hlo))

    tiles = kernels()
    monkeypatch.setitem(platform.FORCED, "tiles", "cpu")
    rows = kernels()
    assert tiles[0] < rows[0] and tiles[1] <= rows[1], (tiles, rows)


@needs_libtpu
def test_exchange_pieces_travel_in_whole_tiles(chips, monkeypatch):
    """The FSDP exchange's pieces go as ``rows.lanes`` lays them out (each chip's row a
    run of whole tiles), so reading a matrix out of them is a slice: the compiled step
    has fewer copies than with ``(N, width)`` pieces, whose rows share every tile."""
    from muon_optax.step import rows as buffer_rows

    def copies():
        _, hlo, _ = compile_step("fsdp", chips)
        return len(re.findall(r" copy\(", hlo)), len(re.findall(r" fusion\(", hlo))

    tiles = copies()
    monkeypatch.setattr(buffer_rows, "lane_of", lambda *sizes: 1)   # (N, width) pieces
    rows = copies()
    assert tiles[0] < rows[0], (tiles, rows)


@needs_libtpu
def test_fsdp_moves_muon_matrices_by_all_to_all_and_gathers_none(chips):
    params, hlo, ops = compile_step("fsdp", chips)
    assert set(ops) == {"all-to-all"}, ops      # to the owners and back, nothing else
    # On TPU each way goes in column pieces (exchange.exchange_piece): at least one each.
    assert ops["all-to-all"]["count"] >= 2, ops
    assert not gathered_shapes(hlo) & muon_shapes(params)
    assert_polar_loop(hlo)


@needs_libtpu
def test_zero2_reduce_scatters_by_all_to_all_and_gathers_the_params(chips):
    import numpy as np

    params, hlo, ops = compile_step("zero2", chips)
    # TPU's compiler makes psum_scatter an all-reduce of the whole gradient and a slice;
    # the sharded step sends each owner its share by all-to-all and sums it there.
    assert ops["all-to-all"]["count"] >= 1 and "reduce-scatter" not in ops, ops
    assert ops.get("all-reduce", {"bytes": 0})["bytes"] <= 64, ops   # scalars at most
    matrices = sum(4 * int(np.prod(s)) for s in muon_shapes(params))
    assert ops["all-gather"]["bytes"] >= matrices, ops   # the updated params, to every chip
    assert_polar_loop(hlo)


@needs_libtpu
def test_exchange_pieces_wait_behind_barriers_on_tpu(chips):
    """As lowered for the TPU, the exchange's pieces are packed from gradients held back
    by an optimization barrier (``order.wait_for``): the TPU compiler keeps it, and
    builds no kernel for it as it does for the arithmetic XLA:CPU needs."""
    from benchmarks import common, tpu_compile

    params = common.nanochat_params(WIDTH, 1, VOCAB, abstract=True)
    fn, args, _, _ = tpu_compile.build("fsdp", params, chips)
    assert "stablehlo.optimization_barrier" in fn.lower(*args).as_text()


def all_to_all_sizes(hlo: str) -> list[int]:
    """The element counts of the HLO's all-to-all results."""
    return [math.prod(int(d) for d in dims.split(",")) for dims in
            re.findall(r"= \w+\[([\d,]+)\][^ ]* all-to-all(?:-start)?\(", hlo)]


@needs_libtpu
def test_zero2_moves_the_muon_matrices_in_pieces(chips, monkeypatch):
    """The gradients' reduce-scatter and the directions' all-gather, each in pieces of
    ``scatter_piece`` elements a chip: more collectives, the same bytes."""
    from muon_optax.step import transport

    _, _, whole = compile_step("zero2", chips)
    piece = 16384   # elements of each chip's row: a (4, piece) buffer in flight at a time
    monkeypatch.setattr(transport, "scatter_piece", lambda owner: piece)
    _, hlo, ops = compile_step("zero2", chips)
    muon = [n for n in all_to_all_sizes(hlo) if n <= len(chips) * piece]
    assert len(muon) >= 4 and ops["all-to-all"]["count"] > whole["all-to-all"]["count"], ops
    assert ops["all-gather"]["count"] >= whole["all-gather"]["count"] + 3, (ops, whole)
    for op in ("all-to-all", "all-gather"):
        assert ops[op]["ring"] == whole[op]["ring"], (op, ops, whole)


@needs_libtpu
def test_zero2_pieces_narrow_on_64_chips(monkeypatch):
    """On a v5p 4x4x4 slice a chip's row of the Muon buffer is about one largest matrix:
    each piece of the gradients' all-to-all holds at most ``PIECE_MATRICES`` of them, but
    ``PIECE_ELEMENTS`` at least: this tiny model's rows go in one piece, the same bytes."""
    from jax.experimental import topologies

    from muon_optax.step import transport

    devices = list(topologies.get_topology_desc(topology_name="v5p:4x4x4",
                                                platform="tpu").devices)
    _, _, floored = compile_step("zero2", devices)
    monkeypatch.setattr(transport, "PIECE_ELEMENTS", 0)
    params, hlo, ops = compile_step("zero2", devices)
    largest = max(math.prod(s) for s in muon_shapes(params))
    sizes = all_to_all_sizes(hlo)
    assert len(sizes) >= transport.PIECE_MATRICES, sizes
    assert max(sizes) <= transport.PIECE_MATRICES * largest, (sizes, largest)
    assert floored["all-to-all"]["count"] <= ops["all-to-all"]["count"] - len(sizes) // 2
    assert floored["all-to-all"]["ring"] == ops["all-to-all"]["ring"], (floored, ops)


@needs_libtpu
def test_zero2_reduce_scatters_a_large_adamw_gradient_in_pieces(chips, monkeypatch):
    """An AdamW gradient over ``SCATTER_PIECE_BYTES`` goes in pieces (the embedding and
    the head: 512 KiB each here): more all-to-alls, the same bytes."""
    from muon_optax.step import collectives

    _, _, whole = compile_step("zero2", chips)
    monkeypatch.setattr(collectives, "SCATTER_PIECE_BYTES", 128 * 2**10)
    _, _, ops = compile_step("zero2", chips)
    # the embedding (512, 256) in 2 pieces of 128 columns, the head (256, 512) in 4
    assert ops["all-to-all"]["count"] == whole["all-to-all"]["count"] + 4, (ops, whole)
    assert ops["all-to-all"]["ring"] == whole["all-to-all"]["ring"], (ops, whole)


@needs_libtpu
def test_head_blocks_under_head_parallel_stay_where_they_lie(chips):
    params, hlo, ops = compile_step("heads_tp", chips)
    attention = (WIDTH, WIDTH)
    assert attention not in gathered_shapes(hlo)     # no attention kernel gathered whole
    assert not gathered_shapes(hlo) & muon_shapes(params), gathered_shapes(hlo)
    assert "all-reduce" not in ops and "reduce-scatter" not in ops, ops
    assert_polar_loop(hlo)
    # The replicated wte and lm_head keep their AdamW moments whole on the 2 owner chips
    # (plan.SPLIT_MOMENTS_MIN_DEVICES): no update gathered, the all-to-alls the only collective.
    assert set(ops) == {"all-to-all"}, ops


# ----------------------------------------------------------------------------- --aot dry run


def test_aot_without_libtpu_says_how_to_install_it(monkeypatch, capsys, tmp_path, corpus):
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "libtpu" else find_spec(name, *a))
    status = train.main([*TINY, "--aot", "v5p:1", "--data", str(corpus),
                         "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith("train.py: error: --aot needs libtpu"), err
    assert 'pip install -e ".[tpu]"' in err[0] and "Python 3.12" in err[0]
    assert not (tmp_path / "out").exists()


@needs_libtpu
@pytest.mark.parametrize("topology, extra, mode, collectives", [
    ("v5p:1", [], "one device", ["none"]),
    ("v5p:2x2x1", [], "ZeRO-2", ["all-to-all", "all-gather"]),
    ("v5p:2x2x1", ["--fsdp"], "FSDP", ["all-to-all", "all-gather"]),
], ids=["one chip", "ZeRO-2", "FSDP"])
def test_aot_dry_run_compiles_the_whole_step_and_touches_nothing(
        capsys, tmp_path, corpus, topology, extra, mode, collectives):
    out = tmp_path / "out"
    status = train.main([*TINY, "--aot", topology, "--data", str(corpus), "--out", str(out),
                         *extra])
    text = capsys.readouterr().out
    assert status == 0, text
    assert f"[muon] --aot {topology} (" in text and f"), {mode}: the train step (forward, " \
        "backward, optimizer) compiled by the TPU compiler" in text
    assert re.search(r"per chip, from shapes: params [\d.]+ KiB, grads [\d.]+ KiB, optimizer "
                     r"state [\d.]+ KiB", text)
    assert re.search(r"temporaries [\d.]+ [KM]iB", text)
    assert re.search(r"of 95 GiB HBM: [\d.]+%, fits", text)
    line = next(ln for ln in text.splitlines() if "collectives per step:" in ln)
    for kind in collectives:
        assert kind in line, line
    assert not out.exists()                      # nothing written, no directory made


@needs_libtpu
def test_aot_names_a_bad_topology_and_the_flags_it_cannot_take(capsys, tmp_path, corpus):
    args = [*TINY, "--data", str(corpus), "--out", str(tmp_path / "out")]
    assert train.main([*args, "--aot", "v5p:3x3x3x3"]) == 2
    assert "--aot v5p:3x3x3x3: not a TPU topology libtpu knows" in capsys.readouterr().err
    assert train.main([*args, "--aot", "v5p:2x2x1", "--devices", "2"]) == 2
    assert "drop --devices 2" in capsys.readouterr().err


@needs_libtpu
def test_aot_refuses_a_step_too_big_for_the_chip_in_one_line(capsys, tmp_path, corpus):
    big = tmp_path / "big.txt"   # 192 x 4097 bytes per batch and 20 times that in all
    big.write_bytes(corpus.read_bytes() * 400)
    status = train.main(["--depth", "1", "--seq-len", "4096", "--batch-size", "192",
                         "--aot", "v5e:1x1", "--data", str(big), "--out", str(tmp_path / "o")])
    err = capsys.readouterr().err.strip().splitlines()
    assert status == 2
    assert len(err) == 1 and err[0].startswith(
        "train.py: error: --aot v5e:1x1: the train step does not fit a chip ("), err
    assert "HBM" in err[0] and err[0].endswith(
        "lower --batch-size, --seq-len or --depth, or use --dtype bfloat16"), err


@needs_libtpu
def test_tpu_kernels_names_the_lines_the_compiler_spends_on(capsys):
    """``benchmarks/tpu_kernels.py`` on a tiny FSDP step: libtpu's log read in a child
    process, every kernel's time summed by a muon_optax source line."""
    from benchmarks import tpu_kernels

    kernels, stages, hlo = tpu_kernels.compile_logged("fsdp", f"d{WIDTH}x1", "v5p:8", VOCAB, 300)
    assert len(kernels) > 10 and stages["BACKEND_PASSES"] > 0, stages
    rows = tpu_kernels.by_source(kernels, tpu_kernels.source_lines(hlo))
    assert sum(r[1] for r in rows) == len(kernels)
    assert any(r[0].startswith(("rule/", "step/")) for r in rows[:5]), rows[:5]
