"""The package as installed (PEP 561 marker shipped, every folder a package, public names
exported) and as written (layers importing one way, small modules)."""

import ast
import dataclasses
import tomllib
from importlib import resources
from pathlib import Path

import muon_optax
from muon_optax.rule import hparams

ROOT = Path(__file__).resolve().parents[1]


def test_py_typed_is_in_the_package_and_shipped():
    assert (resources.files("muon_optax") / "py.typed").is_file()
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert "py.typed" in config["tool"]["setuptools"]["package-data"]["muon_optax"]


def test_public_names():
    for name in muon_optax.__all__:
        assert hasattr(muon_optax, name), name
    assert "current_hyperparams" in muon_optax.__all__


# The folders bottom to top: a module imports from its own folder or those below.
LAYERS = ("rule", "params", "plan", "step", "state", "tools", "api")
MAX_MODULE_LINES = 450


def _modules():
    for path in sorted((ROOT / "muon_optax").rglob("*.py")):
        yield path.relative_to(ROOT / "muon_optax"), ast.parse(path.read_text())


def _imported(tree):
    """``muon_optax.*`` modules imported by ``tree``, with the names taken from each."""
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("muon_optax"):
            yield node.module, [a.name for a in node.names]
        elif isinstance(node, ast.Import):
            yield from ((a.name, []) for a in node.names if a.name.startswith("muon_optax"))


def test_every_folder_is_a_package_and_shipped():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert config["tool"]["setuptools"]["packages"]["find"]["include"] == ["muon_optax*"]
    folders = {p.name for p in (ROOT / "muon_optax").iterdir()
               if p.is_dir() and p.name != "__pycache__"}
    assert folders == set(LAYERS)
    for name in LAYERS:
        assert (ROOT / "muon_optax" / name / "__init__.py").is_file(), name


def test_folders_import_only_their_own_and_those_below():
    found = []
    for rel, tree in _modules():
        if len(rel.parts) == 1:      # muon_optax/__init__.py: the public API, on top
            continue
        mine = LAYERS.index(rel.parts[0])
        for module, names in _imported(tree):
            parts = module.split(".")
            targets = [parts[1]] if len(parts) > 1 else names   # `from muon_optax.x import`
            for target in targets:
                if target not in LAYERS or LAYERS.index(target) > mine:
                    found.append(f"{rel}: {module} {names}")
    assert not found, found


def test_no_module_imports_another_modules_private_names():
    # A module's private names are its own business: what another module needs is public.
    found = [f"{rel}: {module}.{name}" for rel, tree in _modules()
             for module, names in _imported(tree) for name in names if name.startswith("_")]
    assert not found, found


def test_no_module_is_over_the_line_budget():
    long = {str(rel): n for rel, _ in _modules()
            if (n := len((ROOT / "muon_optax" / rel).read_text().splitlines()))
            > MAX_MODULE_LINES}
    assert not long, long


# Switches that exist only to reproduce optax.contrib.muon and optax.adamw (rule/contrib.py).
OPTAX_ONLY = {"optax_ema", "eps_root", "adam", "adaptive", "consistent_rms", "complement",
              "bias_correction", "scale_decay", "momentum_complement"}


def test_nanochats_kernels_take_none_of_optaxs_switches():
    """rule/adamw.py and rule/muon.py are nanochat's rule alone; optax's emulation lives in
    rule/contrib.py (its configs subclass or mirror nanochat's, its kernels beside)."""
    found = []
    for rel, tree in _modules():
        if str(rel) in ("rule/adamw.py", "rule/muon.py"):
            words = {getattr(node, a) for node in ast.walk(tree)
                     for a in ("id", "arg", "attr", "value") if isinstance(
                         getattr(node, a, None), str)}
            found += [f"{rel}: {w}" for w in sorted(words & OPTAX_ONLY)]
    for config in (hparams.AdamWConfig, hparams.MuonConfig):
        found += [f"{config.__name__}.{f.name}" for f in dataclasses.fields(config)
                  if f.name in OPTAX_ONLY]
    assert not found, found
