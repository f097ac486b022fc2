"""muon_optax: nanochat's Muon + AdamW optimizer for JAX, as optax transformations (usage: the
README). Each folder imports only from itself and those above it (``tests/test_package.py``):

    rule/    the rules on arrays (nanochat's; optax's, torch's): polar iteration, kernels, hparams
    params/  what the params are: labels, dimension numbers, matrix leaves, stacks
    plan/    the static plan: owners, transports, layouts, the state's layout
    step/    the traced update: one device, sharded, the transports, the mesh= form
    state/   tx.init, states inside optax wrappers, portable and optax states
    tools/   describe and estimate
    api/     the public constructors

One update: ``step/engine.py:local_update`` steps the AdamW leaves where they lie (their group
config's ``step``: ``rule/adamw.py``, or optax's Adam in ``rule/contrib.py``), then Muon:
``step/one_device.py`` on one device, else ``step/sharded.py``, which loads each stack's owned
matrices through ``step/transport.py`` (``step/exchange.py`` for split ones), runs the group's
kernel (``rule/muon.py``) and stores the directions back; ``step/matrices.py`` finishes each
leaf (the cautious update). Under ``mesh=``, ``step/jit_mode.py`` wraps it in a shard_map.
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
