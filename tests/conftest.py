"""Test session setup: 8 simulated CPU devices, and the tests dir importable.

XLA reads ``XLA_FLAGS`` once, when jax creates its CPU backend, so the device count
has to be set here, at conftest import time, before any test module imports jax.
Tests that do not shard keep using the default device (device 0) as before.
"""

import os
import sys
from pathlib import Path

NUM_CPU_DEVICES = 8
_FLAG = "--xla_force_host_platform_device_count"

_flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if not f.startswith(_FLAG)]
os.environ["XLA_FLAGS"] = " ".join(_flags + [f"{_FLAG}={NUM_CPU_DEVICES}"])

# Helpers (reference.py, sharded_problem.py, multihost_worker.py) import as top-level
# modules whatever pytest's rootdir and import mode.
TESTS_DIR = Path(__file__).resolve().parent
if str(TESTS_DIR) not in sys.path:
    sys.path.insert(0, str(TESTS_DIR))

