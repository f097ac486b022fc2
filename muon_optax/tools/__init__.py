"""Reports about a transformation: ``describe`` and ``estimate``."""
