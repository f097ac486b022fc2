"""Test session setup: 8 simulated CPU devices, cheap compiles, the tests dir importable.

XLA reads ``XLA_FLAGS`` once, when jax creates its CPU backend, so the flags have to be
set here, at conftest import time, before any test module imports jax (processes the
tests start inherit them). Tests that do not shard keep using the default device
(device 0). The suite is dominated by compile time, so LLVM's code generation is cheap
(``--xla_backend_optimization_level=0``): the optimized HLO (fusions, collectives) is the
same, only the machine code is less optimized; the benchmarks compile normally.
"""

import os
import sys
from pathlib import Path

NUM_CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

_CHEAP = ["--xla_backend_optimization_level=0", "--xla_llvm_disable_expensive_passes=true"]
_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
os.environ["XLA_FLAGS"] = " ".join([f for f in _flags if f not in _CHEAP] + _CHEAP
                                   + [f"{_FLAG}={NUM_CPU_DEVICES}"])

# Helpers (reference.py, sharded_problem.py, multihost_worker.py) import as top-level
# modules whatever pytest's rootdir and import mode.
TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

