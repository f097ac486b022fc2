"""The GPT example refuses bad input before any compile: one line, exit status 2.

In-process (``train.main``); none of these runs trains, so the file takes seconds.
Also here: the memory estimate, an out-of-memory error turned into one line, and the
strict JSON of ``log.jsonl``.
"""

import json
import math
import os
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("flax")
pytest.importorskip("orbax.checkpoint")

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "gpt"
if str(EXAMPLE) not in sys.path:
    sys.path.insert(0, str(EXAMPLE))

import data  # noqa: E402
import memory  # noqa: E402
import report  # noqa: E402
import train  # noqa: E402

TINY = ["--depth", "1", "--seq-len", "16", "--batch-size", "2", "--steps", "4",
        "--eval-batches", "1", "--no-progress"]



def refused(capsys, argv, *expected):
    """Runs ``train.main(argv)``: status 2 and one ``error:`` line naming ``expected``.
    Returns what the run printed on stdout."""
    assert train.main([str(a) for a in argv]) == train.EXIT_USAGE
    out, err = capsys.readouterr()
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("train.py: error: "), err
    for text in expected:
        assert text in lines[0], lines[0]
    return out


@pytest.mark.parametrize("flags, expected", [
    (["--max-bytes", "0"], "--max-bytes must be >= 1, got 0"),
    (["--max-bytes", "-5"], "--max-bytes must be >= 1, got -5"),
    (["--final-lr-frac", "-1"], "--final-lr-frac must be in [0, 1], got -1"),
    (["--warmdown-frac", "1.5"], "--warmdown-frac must be in [0, 1]"),
    (["--matrix-lr", "-0.02"], "--matrix-lr must be a positive number, got -0.02"),
    (["--embedding-lr", "0"], "--embedding-lr must be a positive number"),
    (["--adamw-lr", "nan"], "--adamw-lr must be a positive number"),
    (["--weight-decay", "-1"], "--weight-decay must be >= 0"),
    (["--lr-scale", "0"], "--lr-scale must be a positive number or 'nanochat'"),
    (["--warmup-steps", "50", "--steps", "10"], "--warmup-steps must be in [0, --steps = 10]"),
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--seq-len", "0"], "--seq-len must be >= 1"),
    (["--head-dim", "3"], "--head-dim must be even"),
    (["--muon-blocks", "group:2"], "--muon-blocks must be none, heads or groups:G"),
    (["--muon-blocks", "groups:0"], "--muon-blocks must be none, heads or groups:G"),
    (["--head-dim", "16", "--muon-blocks", "groups:3"],
     "3 heads per block do not divide the model's 4 heads"),
    (["--eval-every", "-1"], "--eval-every must be >= 0"),
    (["--batch-size", "3", "--devices", "2"], "not divisible by --devices 2"),
    (["--process-id", "1"], "need --distributed"),
    (["--seed", "-1"], "--seed must be in [0, 2**63 - 1], got -1"),
    (["--seed", str(2**64)], "--seed must be in [0, 2**63 - 1]"),
    (["--steps", "10000000000"], "--steps must be <= 2,147,483,647"),
    (["--matrix-lr", "1e308", "--lr-scale", "1e308"], "--matrix-lr 1e+308 times --lr-scale"),
    (["--embedding-lr", "1e38"], "overflows float32"),
    (["--head-dim", "1000000"], ("does not fit", "head dim 1000000")),
    (["--depth", "1000"], ("does not fit", "depth 1000")),
    (["--distributed", "--coordinator", "notahost:abc"], "the port must be a number"),
    (["--distributed", "--coordinator", "127.0.0.1"], "--coordinator must be host:port"),
    (["--distributed", "--coordinator", "no-such-host.invalid:1234"], "cannot resolve host"),
    (["--distributed", "--init-timeout", "0"], "--init-timeout must be >= 1"),
])
def test_numbers_out_of_range_are_refused(capsys, tmp_path, corpus, flags, expected):
    expected = (expected,) if isinstance(expected, str) else expected
    refused(capsys, [*TINY, "--data", corpus, "--out", tmp_path, *flags], *expected)


def test_a_refused_start_leaves_the_earlier_run_alone(capsys, tmp_path, corpus):
    """Inputs that pass argparse but not the run: refused before ``--out`` is touched."""
    (tmp_path / "ckpt" / "4").mkdir(parents=True)
    (tmp_path / "log.jsonl").write_text('{"step": 4}\n')
    (tmp_path / "config.json").write_text('{"status": "finished"}')
    for flags in (["--seed", "-1"], ["--steps", "10000000000"], ["--depth", "1000"],
                  ["--matrix-lr", "1e308", "--lr-scale", "1e308"]):
        refused(capsys, [*TINY, "--data", corpus, "--out", tmp_path, *flags])
    assert (tmp_path / "ckpt" / "4").is_dir()
    assert (tmp_path / "log.jsonl").read_text() == '{"step": 4}\n'
    assert (tmp_path / "config.json").read_text() == '{"status": "finished"}'


def test_a_binary_data_file_is_refused_like_folders_skip_it(capsys, tmp_path):
    noise = tmp_path / "noise.bin"
    noise.write_bytes(np.random.default_rng(0).integers(0, 256, 200_000, np.uint8).tobytes())
    refused(capsys, [*TINY, "--data", noise, "--out", tmp_path / "out"], "is not text")
    png = tmp_path / "img.png"
    png.write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 100)
    refused(capsys, [*TINY, "--data", png, "--out", tmp_path / "out"], "is not text")


def test_skipped_files_in_a_folder_are_counted(tmp_path):
    folder = tmp_path / "texts"
    folder.mkdir()
    (folder / "a.txt").write_text("alpha " * 100)
    (folder / "b.txt").write_text("beta " * 100)
    (folder / "c.bin").write_bytes(b"\x00\x01" * 100)
    (folder / "d.txt").write_bytes("caf\xe9".encode("latin-1") * 10)  # not UTF-8
    corpus = data.read_corpus(folder)
    assert (corpus.files_read, corpus.files_skipped) == (2, 2)
    assert "2 text files; 2 skipped: binary or not UTF-8" in corpus.describe()
    dataset = data.ByteDataset.from_path(folder, batch_size=1, seq_len=4, val_frac=0.1)
    assert "2 skipped" in dataset.source


def test_out_that_is_a_file_is_refused(capsys, tmp_path, corpus):
    target = tmp_path / "taken"
    target.write_text("not a directory")
    refused(capsys, [*TINY, "--data", corpus, "--out", target], "is a file, not a directory")
    refused(capsys, [*TINY, "--data", corpus, "--out", target / "run"], "is a file")


def test_a_checkpoint_with_a_device_bound_state_is_refused(capsys, tmp_path, corpus):
    """A checkpoint of an earlier train.py (its state laid out for its device count, no
    ``"state"`` entry in the meta): --resume says so in one line instead of failing to
    restore."""
    import jax.numpy as jnp
    from checkpoints import Checkpoints

    argv = [*TINY, "--data", corpus, "--out", tmp_path]
    args = train.build_parser().parse_args([str(a) for a in argv])
    ctx = train._setup(args, train._load_data(args), [])
    capsys.readouterr()
    ckpts = Checkpoints(tmp_path / "ckpt", keep=2, every=0)
    meta = {"step": 2, "data_position": 2, "config": train._config_key(ctx, "muon")}
    ckpts.save(2, {"w": jnp.zeros(3)}, {"mu": jnp.zeros(3)}, meta, force=True)
    ckpts.close()
    refused(capsys, [*argv, "--resume"], "holds the optimizer state in another form",
            "without --resume")


def test_a_model_too_big_for_the_device_is_refused_before_it_is_built(
        capsys, tmp_path, corpus, monkeypatch):
    # Room for the params and gradients (655 kB: the early check passes), not the state.
    monkeypatch.setattr(memory, "device_memory",
                        lambda device, n: (1_000_000, "a test device has 1.0 MB"))
    out = refused(capsys, [*TINY, "--data", corpus, "--out", tmp_path],
                  "does not fit", "81,922 params", "a test device has 1.0 MB", "--depth")
    assert "model: depth 1" in out and "memory per device (estimate)" in out
    assert not (tmp_path / "config.json").exists()  # refused before the run began


def test_out_of_memory_becomes_one_line(capsys, tmp_path, corpus, monkeypatch):
    def exhausted(*args, **kwargs):
        raise RuntimeError("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 1 TB")

    monkeypatch.setattr(train, "_train_one", exhausted)
    refused(capsys, [*TINY, "--data", corpus, "--out", tmp_path],
            "out of memory on cpu", "81,922 params", "--batch-size", "--depth")


def test_the_plan_and_memory_estimate_come_before_the_model(tmp_path, corpus, capsys):
    args = train.build_parser().parse_args([*TINY, "--data", str(corpus), "--out",
                                            str(tmp_path), "--devices", "2"])
    ctx = train._setup(args, train._load_data(args), [])
    out = capsys.readouterr().out
    assert "81,922 params" in out and "memory per device (estimate): params 327.7 kB" in out
    est = ctx.estimate
    assert est.params == est.grads == 81_922 * 4
    # The early size check's arithmetic counts the params the model has.
    assert train.param_count(1, 64) == train._count_params(ctx.abstract_params) == 81_922
    # ZeRO-2 over 2 devices: about half of the single device's optimizer state.
    one = train._setup(train.build_parser().parse_args([*TINY, "--data", str(corpus), "--out",
                                                        str(tmp_path)]),
                       ctx.dataset, []).estimate
    assert 0.45 < est.state["muon"] / one.state["muon"] < 0.6
    # What the state of one device really holds.
    import jax

    tx, sharded = train._make_tx(ctx, "muon", ctx.abstract_params)
    steps = train._build_steps(ctx, tx, sharded)
    state = steps.init(ctx.init_params())
    held = sum(s.data.nbytes for x in jax.tree.leaves(state) for s in x.addressable_shards
               if s.device == ctx.devices[0])
    assert held == est.state["muon"]


def test_the_log_is_strict_json(tmp_path):
    log = report.RunLog(tmp_path / "log.jsonl", 0, write=True)
    log.write({"step": 1, "loss": 2.5})
    log.write({"step": 2, "loss": math.nan, "val_loss": math.inf})
    log.close()

    def refuse(name):
        raise ValueError(f"not strict JSON: {name}")

    lines = (tmp_path / "log.jsonl").read_text().splitlines()
    records = [json.loads(line, parse_constant=refuse) for line in lines]
    assert records[1] == {"step": 2, "loss": None, "val_loss": None,
                          "nonfinite": {"loss": "nan", "val_loss": "inf"}}


def test_device_memory_of_accelerators_and_of_simulated_cpu_devices():
    class Accelerator:
        platform, device_kind = "gpu", "NVIDIA H200"

        def memory_stats(self):
            return {"bytes_limit": 150_000_000_000, "bytes_in_use": 0}

    assert memory.device_memory(Accelerator(), 8) == (150_000_000_000,
                                                     "a NVIDIA H200 has 150.0 GB")
    import jax

    cpu = jax.devices("cpu")[0]
    whole, _ = memory.device_memory(cpu, 1)
    share, phrase = memory.device_memory(cpu, 4)
    assert share == whole // 4 and "for 4 simulated devices" in phrase


def test_max_bytes_bounds_the_read(tmp_path):
    """A 20 MB file with --max-bytes 10000: the read holds 10 kB, not the file; a
    character cut at the limit is not taken for binary data."""
    import tracemalloc

    big = tmp_path / "big.txt"
    big.write_bytes("é".encode() * 10_000_000)
    tracemalloc.start()
    corpus = data.read_corpus(big, max_bytes=10_001)  # ends in half an "é"
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(corpus.data) == 10_001 and peak < 1_000_000, peak
    folder = tmp_path / "texts"
    folder.mkdir()
    big.rename(folder / "big.txt")
    tracemalloc.start()
    corpus = data.read_corpus(folder, max_bytes=10_001)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert len(corpus.data) == 10_001 and corpus.files_read == 1 and peak < 1_000_000, peak
    # A limit beyond the file reads the file (not a buffer of the limit's size).
    assert len(data.read_corpus(folder, max_bytes=10**20).data) == 20_000_000


def test_a_fifo_or_device_is_not_data(capsys, tmp_path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    for path in (fifo, "/dev/zero"):
        refused(capsys, [*TINY, "--data", path, "--out", tmp_path / "out"],
                "is neither a regular file nor a directory")


def test_data_larger_than_memory_is_refused_before_the_read(capsys, tmp_path):
    """A (sparse) 4 TB file without --max-bytes: its size is read first and the run
    refused in one line saying what to do, instead of a MemoryError from the read."""
    huge = tmp_path / "huge.txt"
    try:
        with open(huge, "wb") as f:
            f.truncate(4 << 40)
    except OSError:
        pytest.skip("this file system holds no 4 TB sparse file")
    refused(capsys, [*TINY, "--data", huge, "--out", tmp_path / "out"],
            "holds 4,398,046,511,104 bytes", "with --max-bytes")
    folder = tmp_path / "texts"
    folder.mkdir()
    huge.rename(folder / "huge.txt")
    refused(capsys, [*TINY, "--data", folder, "--out", tmp_path / "out"],
            f"data directory {str(folder)!r} holds", "with --max-bytes")
    # With --max-bytes the size does not matter (its zeros are then refused as not text).
    refused(capsys, [*TINY, "--data", folder / "huge.txt", "--out", tmp_path / "out",
                     "--max-bytes", 1000], "is not text")
