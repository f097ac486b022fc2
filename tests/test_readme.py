"""The README's quickstart, multi-device and optax.contrib snippets run as pasted."""

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", [0, 1, 2], ids=["quickstart", "multi-device", "contrib"])
def test_readme_snippet_runs(index):
    assert jax.device_count() == 8  # conftest's simulated devices: the mesh snippet uses all
    namespace = {}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    assert "params" in namespace and "state" in namespace
