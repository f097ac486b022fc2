"""The program each platform runs where they differ, chosen when the step is lowered.

Where the TPU's compiler (pieces, loops, a barrier) or the accelerators' bfloat16 want
another program than XLA:CPU, both are written and :func:`per_platform` picks one with
``jax.lax.platform_dependent``: at lowering, not by the process's default backend, so a
step compiled ahead of time for a TPU on a CPU host is the TPU's. Tests run a site's
accelerator form on XLA:CPU through :data:`FORCED`, and check it bit for bit against
the CPU form.
"""

from __future__ import annotations

from typing import Any

import jax

# {site: platform} for tests: the form that site takes wherever the step is compiled.
# Sites: "polar" (bfloat16, batched: muon_optax.rule.polar), "loop" (a stack's chunks in
# loops: muon_optax.step.one_device, .sharded), "scatter" (a large AdamW gradient's
# reduce-scatter in pieces: muon_optax.step.collectives), "gather" and "exchange" (the
# transports' pieces), "tiles" (the transports' buffers in tile order:
# muon_optax.step.rows), "order" (barriers: muon_optax.rule.order), "late_adamw" (the
# barrier before split AdamW leaves: muon_optax.step.engine).
FORCED: dict[str, str] = {}


def per_platform(site: str, *args: Any, default: Any, **forms: Any) -> Any:
    """``forms[platform](*args)`` for the platform the step is lowered for (``cpu``,
    ``tpu``, ``cuda``, ``rocm``), ``default(*args)`` for the others; the form of
    ``FORCED[site]`` wherever it is set. Every form returns the same types."""
    forced = FORCED.get(site)
    if forced is not None:
        return forms.get(forced, default)(*args)
    return jax.lax.platform_dependent(*args, default=default, **forms)
