"""The layout a state was made for, kept in its treedef (free: ``jax.jit`` compares treedefs
when it traces). Params split otherwise, or on another device count, may give Muon buffers of
the same shapes whose rows belong to other matrices: ``update`` refuses such a state."""

from __future__ import annotations

import collections
import dataclasses
import hashlib
from typing import Any

import jax


@jax.tree_util.register_static
@dataclasses.dataclass(frozen=True)
class StateLayout:
    """What a state's Muon buffers mean: the device count and a digest of every state channel
    (which matrix sits at each offset of each device's share, how stored). ``transports`` only
    describes (the same owners serve replicated and FSDP-split params); ``specs``: the layouts
    an eager ``init`` saw, for an ``update`` whose traced params' types do not show them."""

    devices: int
    digest: str
    transports: str = dataclasses.field(default="", compare=False)
    specs: tuple | None = dataclasses.field(default=None, compare=False)

    def describe(self) -> str:
        stacks = f", Muon stacks {self.transports}" if self.transports else ""
        return f"{self.devices} device(s){stacks}, layout {self.digest}"


def layout_of(plan: Any) -> StateLayout:
    """The :class:`StateLayout` of a ``TreePlan``, the same on every host (no Python
    ``hash``). AdamW moments are left out: their global arrays mean the same, however split."""
    owner = plan.owner
    parts: list[Any] = [owner.num_devices]
    for kind in (owner.momentum, owner.second):
        for key, ch in kind.items():
            parts.append((tuple(str(k) for k in key), ch.length, ch.sizes, ch.offsets.tolist()))
            for k in ch.stacks:
                sp, st = owner.stacks[k], owner.stacks[k].stack
                parts.append((k, st.rows, st.cols, sp.second_shape, sp.slots.tolist(),
                              tuple((m.index, m.batch, m.blocks, tuple(m.stored_perm))
                                    for m in st.members)))
    digest = hashlib.sha256(repr(parts).encode()).hexdigest()[:12]
    counts = collections.Counter(sp.transport for sp in owner.stacks)
    transports = ", ".join(f"{k} x{v}" for k, v in sorted(counts.items()))
    return StateLayout(owner.num_devices, digest, transports, plan.given)


def layout_error(name: str, got: Any, want: StateLayout) -> ValueError:
    """The error of a state made for another layout (``got``: its layout, or None)."""
    made = got.describe() if isinstance(got, StateLayout) else "an unknown layout"
    return ValueError(
        f"{name}: the state was made for another layout of these params (made for {made}; "
        f"these params need {want.describe()}): its Muon buffers' rows belong to other matrices "
        "here. Move it with muon_optax.export_state (with the params as laid out when it was "
        "made) and muon_optax.import_state (with them as they are now), or call tx.init on them.")
