"""The update rules on arrays: nanochat's (``adamw.py``, ``muon.py``, on ``polar.py``'s
iteration, its groups in ``hparams.py``) and, apart from it, optax's and torch's (``contrib.py``).
Imports nothing else from the package."""
