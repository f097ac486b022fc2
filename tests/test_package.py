"""The package as installed: PEP 561 marker shipped, public names exported."""

import ast
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


def test_no_module_imports_another_modules_private_names():
    # A module's private names are its own business: what another module needs is public.
    found = []
    for path in sorted((ROOT / "muon_optax").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("muon_optax"):
                found += [f"{path.name}: {node.module}.{a.name}" for a in node.names
                          if a.name.startswith("_")]
    assert not found, found
