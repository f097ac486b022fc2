"""The program each platform runs where they differ, chosen when the step is lowered
(``jax.lax.platform_dependent``), not by the default backend: a step compiled ahead of
time for a TPU on a CPU host is the TPU's. Tests force a form through :data:`FORCED`."""

from __future__ import annotations

from typing import Any

import jax

# {site: platform} for tests. Sites: "polar" (rule.polar, .muon), "loop" (step.one_device,
# .sharded), "remainder" (.sharded), "scatter" (step.collectives), "gather", "exchange", "tiles"
# (step.transport, .exchange, .rows), "order" (rule.order), "late_adamw" (step.engine).
FORCED: dict[str, str] = {}


def per_platform(site: str, *args: Any, default: Any, **forms: Any) -> Any:
    """``forms[platform](*args)`` for the platform lowered for (``cpu``, ``tpu``, ``cuda``,
    ``rocm``), else ``default(*args)``, unless ``FORCED[site]`` is set."""
    if site in FORCED:
        return forms.get(FORCED[site], default)(*args)
    return jax.lax.platform_dependent(*args, default=default, **forms)
