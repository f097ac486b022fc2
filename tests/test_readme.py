"""The README's quickstart, multi-device, FSDP and optax.contrib snippets run as pasted."""

import re
from pathlib import Path

import jax
import pytest

README = Path(__file__).resolve().parents[1] / "README.md"
BLOCKS = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)


@pytest.mark.parametrize("index", [0, 1, 2, 3],
                         ids=["quickstart", "multi-device", "fsdp", "contrib"])
def test_readme_snippet_runs(index):
    assert jax.device_count() == 8  # conftest's simulated devices: the mesh snippet uses all
    namespace = {}
    exec(compile(BLOCKS[index], f"README.md block {index}", "exec"), namespace)
    assert "params" in namespace and "state" in namespace
    if index == 2:  # FSDP: the step keeps the params' split, the state split over "data"
        specs = {k: tuple(v.sharding.spec) for k, v in namespace["params"].items()}
        assert specs["w2"] == (None, "data") and specs["embed"][0] == "data", specs
        for leaf in jax.tree.leaves(namespace["state"].muon):
            assert leaf.sharding.spec[0] == "data" and leaf.addressable_shards[0].data.shape[0] == 1
