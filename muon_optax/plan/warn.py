"""Warnings attributed to the user's line, and the one for split params without ``mesh=``."""

from __future__ import annotations

import sys
import warnings
from typing import Any

import jax

# Frames of these packages are skipped, so that a warning names the user's line.
_INTERNAL = ("muon_optax", "jax", "jaxlib", "optax", "flax", "contextlib", "functools")


def warn(message: str) -> None:
    """``warnings.warn`` at the first frame outside ``_INTERNAL``: the user's line."""
    frame, level = sys._getframe(1), 2
    while frame is not None and frame.f_globals.get("__name__", "").split(".")[0] in _INTERNAL:
        frame, level = frame.f_back, level + 1
    warnings.warn(message, stacklevel=level)


def warn_if_split(leaves: list[Any], paths: list[str], name: str) -> None:
    """At an eager ``init`` without ``mesh=``: params split over several devices train
    correctly through GSPMD, but every Muon matrix moves as XLA sees fit (far more bytes)."""
    for path, x in zip(paths, leaves):
        sharding = getattr(x, "sharding", None)
        if isinstance(x, jax.core.Tracer) or not isinstance(x, jax.Array) or sharding is None:
            continue
        if len(sharding.device_set) > 1 and not sharding.is_fully_replicated:
            axes = tuple(getattr(getattr(sharding, "mesh", None), "axis_names", ())) or ("data",)
            axis = axes[0] if len(axes) == 1 else axes
            warn(f"{name}: parameter {path!r} is split over {len(sharding.device_set)} devices "
                 f"({sharding}), but this transformation was built without mesh=, so it runs "
                 "as on one device and XLA moves its data as it sees fit (an FSDP d256 GPT on "
                 f"8 devices: 55x the collective bytes). Build it with axis_name={axis!r}, "
                 "mesh=<the params' mesh> to update each Muon matrix on one owner device.")
            return
