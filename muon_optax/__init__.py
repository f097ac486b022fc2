"""muon_optax: nanochat's Muon + AdamW optimizer for JAX, as optax transformations.

    tx = muon_optax.muon_adamw(groups, muon_optax.label_by_path(rules))
    state = tx.init(params)
    updates, state = tx.update(grads, state, params)

See the README for the mapping from nanochat's ``param_groups``.
"""

from muon_optax.api.contrib import contrib_muon
from muon_optax.api.optimizer import adamw, muon, muon_adamw
from muon_optax.api.torch_muon import torch_muon
from muon_optax.params.dimension_numbers import MuonDimensionNumbers
from muon_optax.params.labels import label_by_path, path_str
from muon_optax.params.variables import load_nnx_optimizer_state
from muon_optax.rule.coefficients import POLAR_EXPRESS_COEFFS
from muon_optax.rule.hparams import current_hyperparams
from muon_optax.rule.polar import orthogonalize
from muon_optax.state.portable import export_state, import_state
from muon_optax.state.wrapped import state_specs
from muon_optax.step.state import MuonAdamWState, MuonBuffers
from muon_optax.tools.describe import describe
from muon_optax.tools.estimate import estimate

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
