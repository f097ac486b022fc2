"""muon_optax: nanochat's Muon + AdamW optimizer for JAX, as optax transformations.

    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(rules))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)

See the README for the mapping from nanochat's ``param_groups``.
"""

from muon_optax.contrib import contrib_muon
from muon_optax.describe import describe
from muon_optax.dimension_numbers import MuonDimensionNumbers
from muon_optax.engine import MuonAdamWState, MuonBuffers
from muon_optax.estimate import estimate
from muon_optax.hparams import current_hyperparams
from muon_optax.labels import label_by_path, path_str
from muon_optax.optimizer import adamw, muon, muon_adamw
from muon_optax.polar import POLAR_EXPRESS_COEFFS, orthogonalize
from muon_optax.portable import export_state, import_state
from muon_optax.sharding import state_specs
from muon_optax.torch_muon import torch_muon
from muon_optax.variables import load_nnx_optimizer_state

__version__ = "0.1.0"

__all__ = [
    "POLAR_EXPRESS_COEFFS",
    "MuonAdamWState",
    "MuonBuffers",
    "MuonDimensionNumbers",
    "adamw",
    "current_hyperparams",
    "describe",
    "estimate",
    "export_state",
    "import_state",
    "contrib_muon",
    "label_by_path",
    "load_nnx_optimizer_state",
    "muon",
    "muon_adamw",
    "orthogonalize",
    "path_str",
    "state_specs",
    "torch_muon",
]
