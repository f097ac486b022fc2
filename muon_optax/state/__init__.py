"""States in and out: ``tx.init``, states in optax wrappers, portable and optax states."""
