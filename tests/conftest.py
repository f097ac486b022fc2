"""Test session setup: 8 simulated CPU devices, cheap compiles, the tests dir importable.

XLA reads ``XLA_FLAGS`` once, when jax creates its CPU backend, so the flags have to be
set here, at conftest import time, before any test module imports jax (processes the
tests start inherit them). Tests that do not shard keep using the default device
(device 0). The suite is dominated by compile time, so LLVM's code generation is cheap
(``--xla_backend_optimization_level=0``): the optimized HLO (fusions, collectives) is the
same, only the machine code is less optimized; the benchmarks compile normally.

Many tests compile the same programs (a one-device reference run, the example GPT's step in
each process a test starts), so the session shares one compilation cache: a directory made
here by the first process, inherited by xdist's workers and every process a test starts,
removed when that first process exits. A cached program is the one XLA built: the results
are the same. A cache directory of one's own (``JAX_COMPILATION_CACHE_DIR``) is left alone;
test_tpu_compile.py turns it off (compile-only programs cannot be read back).
"""

import atexit
import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest

NUM_CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

_CHEAP = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
os.environ["XLA_FLAGS"] = " ".join([f for f in _flags if f not in _CHEAP] + _CHEAP
                                   + [f"{_FLAG}={NUM_CPU_DEVICES}"])

if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _cache = tempfile.mkdtemp(prefix="muon_optax_tests_xla_cache_")
    atexit.register(shutil.rmtree, _cache, ignore_errors=True)
    os.environ.update(JAX_COMPILATION_CACHE_DIR=_cache,   # every program, however small
                      JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0",
                      JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES="-1")

# Helpers (reference.py, sharded_problem.py, multihost_worker.py) import as top-level
# modules whatever pytest's rootdir and import mode.
TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))



@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """A text file for the example GPT's tests: its own sources, 40 KB (tests that compare
    curves across modes use a frozen corpus instead, tests/test_gpt_example.py)."""
    sources = sorted((TESTS_DIR.parent / "examples" / "gpt").glob("*.py"))
    path = tmp_path_factory.mktemp("data") / "corpus.txt"
    path.write_bytes(b"\n".join(p.read_bytes() for p in sources)[:40_000])
    return path
