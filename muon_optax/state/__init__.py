"""States in and out: ``tx.init`` and the state inside optax wrappers, portable export
and import, optax.contrib.muon's state."""
