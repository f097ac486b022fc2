"""The traced update: one device, sharded (with its transports), and the ``mesh=`` form."""
