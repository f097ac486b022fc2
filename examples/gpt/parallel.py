"""How a run is laid out over its devices, and its compiled train and eval steps.

Three modes, one ``"data"`` mesh axis (the batch is always split by rows over it):

==========  ===========================  ========================  ====================
mode        params / grads per device    MuonAdamW state           train step
==========  ===========================  ========================  ====================
one device  all / all                    all                       ``jax.jit``
ZeRO-2      all (replicated) / its rows  split over ``"data"``     ``jax.shard_map``
FSDP        1/N / 1/N                    split over ``"data"``     plain ``jax.jit``
==========  ===========================  ========================  ====================

ZeRO-2 (``--devices N``): each device computes the gradient of its own rows and the
sharded optimizer reduce-scatters them (see :func:`local_value_and_grad`).

FSDP (``--fsdp``): each parameter of two or more axes is split along its first axis that
N divides (:func:`fsdp_spec`), vectors and scalars stay replicated. The train step is
plain ``jax.jit`` over these ``NamedSharding`` s: the loss gathers the params with a
sharding constraint (XLA inserts one all-gather per parameter), the gradients are
constrained back to the params' layout (XLA reduces them: a reduce-scatter where the
backend forms one, on CPU an all-reduce and a slice), and ``muon_optax.muon_adamw(...,
axis_name="data", mesh=mesh, param_specs=...)`` moves each Muon matrix whole to its
owner and back by all-to-all, updates the AdamW params where their shards lie, and
keeps its state split over ``"data"``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

AXIS = "data"


def fsdp_spec(shape: tuple[int, ...], n: int, blocks: dict[int, int] | None = None):
    """FSDP's layout of one parameter over ``n`` devices: split along the first axis that
    ``n`` divides if it has two or more axes; replicated otherwise (vectors, scalars, and
    a matrix no axis of which ``n`` divides). ``blocks`` (``{axis: Muon blocks}``, see
    ``--muon-blocks``): an axis cut into blocks is split only where ``n`` divides its
    block count, so that each device holds whole blocks (updated where they lie); a split
    that cut blocks would have the optimizer gather the kernel whole."""
    from jax.sharding import PartitionSpec as P

    blocks = blocks or {}
    if len(shape) >= 2:
        for axis, size in enumerate(shape):
            if size % n == 0 and blocks.get(axis, n) % n == 0:
                return P(*([None] * axis), AXIS)
    return P()


def _is_spec(x) -> bool:
    from jax.sharding import PartitionSpec

    return isinstance(x, PartitionSpec)


class Layout:
    """Where a run's arrays live: ``mesh`` (None on one device) and the mode.

    Puts host arrays onto the devices. Each process hands over only its own rows of a
    batch (``jax.make_array_from_process_local_data``): with one process that is the
    whole batch, with ``--distributed`` the rows of its devices.
    """

    def __init__(self, mesh, fsdp: bool = False,
                 blocks_of: Callable[[str], dict[int, int]] | None = None):
        import jax
        from jax.sharding import NamedSharding
        from jax.sharding import PartitionSpec as P

        self.mesh, self.fsdp = mesh, fsdp
        self.blocks_of = blocks_of or (lambda path: {})   # a param path -> its Muon blocks
        if mesh is None:
            if fsdp:
                raise ValueError("FSDP needs a mesh")
            self.replicated = self.rows = jax.sharding.SingleDeviceSharding(jax.devices()[0])
        else:
            self.replicated = NamedSharding(mesh, P())
            self.rows = NamedSharding(mesh, P(AXIS))

    @property
    def num_devices(self) -> int:
        return 1 if self.mesh is None else self.mesh.size

    @property
    def mode(self) -> str:
        return "one device" if self.mesh is None else ("FSDP" if self.fsdp else "ZeRO-2")

    def sharding(self, spec):
        from jax.sharding import NamedSharding

        return self.replicated if self.mesh is None else NamedSharding(self.mesh, spec)

    def shardings(self, specs):
        """A tree of ``PartitionSpec`` -> the same tree of shardings."""
        import jax

        return jax.tree.map(self.sharding, specs, is_leaf=_is_spec)

    def split_specs(self, tree):
        """FSDP's rule at every leaf of ``tree`` (arrays or shape structs), on any mesh:
        how params are laid out under ``--fsdp``, and how checkpointed state is laid
        out in every mode (so that no device ever holds all of it)."""
        import jax
        from jax.sharding import PartitionSpec as P

        import muon_optax

        n = self.num_devices

        def spec(path, x):
            if n == 1:
                return P()
            return fsdp_spec(tuple(x.shape), n, self.blocks_of(muon_optax.path_str(path)))
        return jax.tree_util.tree_map_with_path(spec, tree)

    def param_specs(self, params):
        """The params' PartitionSpecs: FSDP's split, or replicated."""
        import jax
        from jax.sharding import PartitionSpec as P

        if self.fsdp:
            return self.split_specs(params)
        return jax.tree.map(lambda _: P(), params)

    def batch(self, x):
        import jax

        if self.mesh is None:
            return jax.device_put(x, self.rows)
        index = self.rows.addressable_devices_indices_map(x.shape).values()
        lo = min(i[0].start or 0 for i in index)
        hi = max(x.shape[0] if i[0].stop is None else i[0].stop for i in index)
        return jax.make_array_from_process_local_data(self.rows, x[lo:hi], x.shape)


class Steps(NamedTuple):
    """A run's compiled functions and where their arrays live.

    ``init(params) -> state``; ``train(params, state, x, y) -> (params, state, loss)``
    (params and state donated); ``eval(params, x, y) -> loss``; ``params`` and ``state``
    are the trees of shardings the steps take and return.
    """

    init: Callable
    train: Callable
    eval: Callable
    params: Any
    state: Any


def local_value_and_grad(loss_of, params, x, y, axis_name: str | None = None):
    """``(loss, grads)`` of this device's rows ``x, y``; the loss averaged over the devices.

    Inside ``jax.shard_map`` the params come in replicated (``P()``), invariant along
    ``axis_name``, and ``jax.grad`` at an invariant input returns the gradient already
    *summed* over the devices: the transpose of handing one value to every device is a
    ``psum``, an all-reduce of every gradient in the backward pass. ``pcast(...,
    to="varying")`` makes each device's copy its own first, so each device gets the
    gradient of its own rows and the reduction is left to the optimizer (ZeRO-2: one
    reduce-scatter, mean). Every device has as many rows, so the mean of the devices'
    losses is the mean over the global batch.
    """
    import jax

    if axis_name is None:
        return jax.value_and_grad(loss_of)(params, x, y)
    local = jax.lax.pcast(params, axis_name, to="varying")
    loss, grads = jax.value_and_grad(loss_of)(local, x, y)
    return jax.lax.pmean(loss, axis_name), grads


def state_specs(layout: Layout, tx, sharded_tx: bool, abstract_params):
    """The optimizer state's PartitionSpecs (None on one device).

    The sharded MuonAdamW's state is split as ``muon_optax.state_specs`` says. A plain
    optax state (``--compare adamw``) is replicated under ZeRO-2 and laid out like the
    params under FSDP (its moments have the params' shapes).
    """
    import jax
    from jax.sharding import PartitionSpec as P

    import muon_optax

    if layout.mesh is None:
        return None
    if sharded_tx:
        return muon_optax.state_specs(tx, abstract_params, layout.mesh)
    shapes = jax.eval_shape(tx.init, abstract_params)
    if layout.fsdp:
        return layout.split_specs(shapes)
    return jax.tree.map(lambda _: P(), shapes)


def build_steps(layout: Layout, tx, sharded_tx: bool, loss_of, abstract_params) -> Steps:
    """The mode's init, train and eval steps (see the module doc).

    ``loss_of(params, x, y)`` is the mean loss of the rows ``x, y``; ``sharded_tx``: the
    transformation was built with ``axis_name`` (MuonAdamW) rather than being a plain
    optax one that needs the gradients averaged first.
    """
    if layout.mesh is None:
        return _single_device_steps(layout, tx, loss_of)
    specs = state_specs(layout, tx, sharded_tx, abstract_params)
    if layout.fsdp:
        return _fsdp_steps(layout, tx, loss_of, abstract_params, specs)
    return _zero2_steps(layout, tx, sharded_tx, loss_of, specs)


def _single_device_steps(layout: Layout, tx, loss_of) -> Steps:
    import jax
    import optax

    def train_step(p, state, x, y):
        loss, grads = jax.value_and_grad(loss_of)(p, x, y)
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    return Steps(jax.jit(tx.init), jax.jit(train_step, donate_argnums=(0, 1)),
                 jax.jit(loss_of), layout.replicated, layout.replicated)


def _zero2_steps(layout: Layout, tx, sharded_tx: bool, loss_of, specs) -> Steps:
    """``jax.shard_map`` over ``"data"``: params replicated (``P()``), the batch split by
    rows, each device's own gradient handed to the sharded optimizer."""
    import jax
    import optax
    from jax.sharding import PartitionSpec as P

    def train_step(p, state, x, y):
        loss, grads = local_value_and_grad(loss_of, p, x, y, AXIS)
        if not sharded_tx:
            grads = jax.lax.pmean(grads, AXIS)  # a replicated optimizer: DDP's all-reduce
        updates, state = tx.update(grads, state, p)
        return optax.apply_updates(p, updates), state, loss

    def eval_step(p, x, y):
        return jax.lax.pmean(loss_of(p, x, y), AXIS)

    mesh, rows = layout.mesh, P(AXIS)
    init = jax.jit(jax.shard_map(tx.init, mesh=mesh, in_specs=P(), out_specs=specs))
    train = jax.jit(jax.shard_map(train_step, mesh=mesh, in_specs=(P(), specs, rows, rows),
                                  out_specs=(P(), specs, P())), donate_argnums=(0, 1))
    evaluate = jax.jit(jax.shard_map(eval_step, mesh=mesh, in_specs=(P(), rows, rows),
                                     out_specs=P()))
    return Steps(init, train, evaluate, layout.replicated, layout.shardings(specs))


def gathered(params, layout: Layout):
    """The whole params, for the forward pass: FSDP's all-gather, as a sharding
    constraint (XLA inserts one all-gather per split parameter, next to its use; the
    transpose, in the backward pass, is the gradients' reduction)."""
    import jax

    return jax.lax.with_sharding_constraint(params, jax.tree.map(lambda _: layout.replicated,
                                                                 params))


def _fsdp_steps(layout: Layout, tx, loss_of, abstract_params, specs) -> Steps:
    """Plain ``jax.jit`` over the params' and state's ``NamedSharding`` s."""
    import jax
    import optax

    params = layout.shardings(layout.param_specs(abstract_params))
    state = layout.shardings(specs)

    def train_step(p, st, x, y):
        loss, grads = jax.value_and_grad(
            lambda q: loss_of(gathered(q, layout), x, y))(p)
        grads = jax.lax.with_sharding_constraint(grads, params)  # reduced to the params' split
        updates, st = tx.update(grads, st, p)
        return optax.apply_updates(p, updates), st, loss

    rows, one = layout.rows, layout.replicated
    init = jax.jit(tx.init, in_shardings=(params,), out_shardings=state)
    train = jax.jit(train_step, in_shardings=(params, state, rows, rows),
                    out_shardings=(params, state, one), donate_argnums=(0, 1))
    evaluate = jax.jit(lambda p, x, y: loss_of(gathered(p, layout), x, y),
                       in_shardings=(params, rows, rows), out_shardings=one)
    return Steps(init, train, evaluate, params, state)
