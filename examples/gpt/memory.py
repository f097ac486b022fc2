"""Memory per device from shapes alone: printed, and checked, before the model is built.

Per device, on N devices:

* params: all of them (one device, ZeRO-2), or under FSDP each split parameter's 1/N
  share (vectors and scalars whole);
* grads: as the params (under ZeRO-2 every device computes the gradients of all params
  for its rows; under FSDP they are reduced to the params' split);
* optimizer state: MuonAdamW's from ``muon_optax.estimate`` for the run's mode (the bytes
  each device allocates, exactly: 1/N of the Muon state and of the large AdamW moments,
  the small params' state whole); ``optax.adamw``'s (``--compare adamw``) from its shapes,
  whole under ZeRO-2, split like the params under FSDP.

Activations and the step's temporaries come on top; they depend on the batch, the
sequence length and XLA's schedule, and are left out.
"""

from __future__ import annotations

import dataclasses
import errno
import math
import os


def per_device_bytes(tree, specs=None, axis_name: str = "data", num_devices: int = 1) -> int:
    """Bytes that one device holds of ``tree`` (arrays or ``jax.ShapeDtypeStruct`` s).

    ``specs`` (a tree of ``PartitionSpec`` like ``tree``, or None for all replicated)
    says which leaves are split over ``axis_name``: those hold ``1 / num_devices`` of
    their (padded, divisible) global shape.
    """
    import jax

    leaves = jax.tree.leaves(tree)
    spec_leaves = ([None] * len(leaves) if specs is None
                   else jax.tree.leaves(specs, is_leaf=lambda s: s is None or _is_spec(s)))
    total = 0
    for leaf, spec in zip(leaves, spec_leaves, strict=True):
        nbytes = math.prod(leaf.shape) * jax.numpy.dtype(leaf.dtype).itemsize
        split = spec is not None and any(
            axis_name == part or (isinstance(part, tuple) and axis_name in part) for part in spec)
        total += nbytes // num_devices if split else nbytes
    return total


def _is_spec(x) -> bool:
    from jax.sharding import PartitionSpec

    return isinstance(x, PartitionSpec)


def optimizer_state_bytes(init, params, specs=None, num_devices: int = 1) -> list[int]:
    """Bytes of an optax optimizer's state on each device, from
    ``jax.eval_shape(init, params)``; ``specs`` are the state's PartitionSpecs over
    ``"data"`` (None: whole on every device)."""
    import jax

    shapes = jax.eval_shape(init, params)
    return [per_device_bytes(shapes, specs, num_devices=num_devices)] * num_devices


def muon_state_bytes(tx, params, num_devices: int, param_specs=None) -> list[int]:
    """MuonAdamW's state bytes on each device, from ``muon_optax.estimate``: ``tx`` built
    with ``axis_name`` (and ``mesh``), ``param_specs`` the params' split (FSDP) or None
    (whole on every device: ZeRO-2, or one device with ``num_devices=1``)."""
    import muon_optax

    return muon_optax.estimate(tx, params, num_devices, param_specs=param_specs)["state_bytes"]


@dataclasses.dataclass(frozen=True)
class Estimate:
    """Bytes per device: params, grads, and each optimizer's state (the largest device)."""

    params: int
    grads: int
    state: dict[str, int]

    @property
    def total(self) -> int:
        """Params + grads + the largest optimizer's state (the runs come one after another)."""
        return self.params + self.grads + max(self.state.values(), default=0)

    def describe(self) -> str:
        state = ", ".join(f"{name} {fmt(b)}" for name, b in self.state.items())
        return (f"params {fmt(self.params)} + grads {fmt(self.grads)} + optimizer state "
                f"({state}) = {fmt(self.total)}, plus activations")


def estimate(params, state_bytes: dict[str, list[int]], param_specs=None,
             num_devices: int = 1) -> Estimate:
    """The estimate for ``params`` laid out as ``param_specs`` say over ``num_devices``
    (None: whole on every device), gradients laid out alike, and each optimizer's
    per-device state bytes."""
    p = per_device_bytes(params, param_specs, num_devices=num_devices)
    return Estimate(params=p, grads=p, state={k: max(v) for k, v in state_bytes.items()})


def fmt(n: float) -> str:
    """Bytes for people: 1.5 MB, 12.3 GB (powers of 1000)."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def device_memory(device, local_devices: int) -> tuple[int | None, str]:
    """``(bytes, phrase)``: what one device may use, and a phrase that says so: the
    accelerator's limit, or on CPU the host's memory shared by this process's (simulated)
    devices; ``(None, "")`` where unknown."""
    stats = None
    try:
        stats = device.memory_stats()
    except Exception:  # some backends do not implement it
        pass
    if stats and stats.get("bytes_limit"):
        limit = int(stats["bytes_limit"])
        return limit, f"a {device.device_kind} has {fmt(limit)}"
    if device.platform == "cpu":
        try:
            host = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            return None, ""
        if local_devices == 1:
            return host, f"this host has {fmt(host)}"
        share = host // local_devices
        return share, (f"this host has {fmt(host)} for {local_devices} simulated devices, "
                       f"{fmt(share)} each")
    return None, ""


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is XLA running out of device memory (at build, compile or run).

    Not a full disk: tensorstore (orbax's writer) reports ENOSPC as ``RESOURCE_EXHAUSTED``
    too, with the OS's words in it."""
    text = str(error)
    if "No space left on device" in text or getattr(error, "errno", None) == errno.ENOSPC:
        return False
    return "RESOURCE_EXHAUSTED" in text or "Out of memory" in text or "out of memory" in text
