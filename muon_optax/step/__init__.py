"""The traced update: on one device, sharded, the transports between the two, and the
``mesh=`` form that runs its own ``shard_map`` under ``jax.jit``."""
