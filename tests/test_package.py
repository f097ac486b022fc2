"""The package as installed: PEP 561 marker shipped, public names exported."""

import tomllib
from importlib import resources
from pathlib import Path

import muon_optax

ROOT = Path(__file__).resolve().parents[1]


def test_py_typed_is_in_the_package_and_shipped():
    assert (resources.files("muon_optax") / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["muon_optax"]


def test_public_names():
    for name in muon_optax.__all__:
        assert hasattr(muon_optax, name), name
    assert "current_hyperparams" in muon_optax.__all__
