"""One process of tests/test_multihost.py: a few sharded steps on a 2-process CPU mesh.

Run by the test (not collected by pytest), once per process, with
``XLA_FLAGS=--xla_force_host_platform_device_count=4`` in the environment:

    python tests/multihost_worker.py --process-id I --num-processes 2 --port P \
        --steps S --out DIR

Every process joins the global mesh over all devices, makes the replicated params with
``jax.make_array_from_process_local_data`` and each step's per-device gradients with
``jax.make_array_from_callback`` (a process makes only its own devices' rows), runs the
sharded step, and writes its copy of the final params to ``DIR/params_I.npz``.

``--mode fsdp``: the params split over the mesh instead (plain jit, ``mesh=``, an
Explicit mesh), every step's gradient the mean one; the final params are gathered
across the processes before they are written.
"""

from __future__ import annotations

import argparse
import os
import sys
import time


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--process-id", type=int, required=True)
    ap.add_argument("--num-processes", type=int, required=True)
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--out", required=True)
    ap.add_argument("--mode", choices=("zero2", "fsdp"), default="zero2")
    args = ap.parse_args(argv)

    import jax

    # CPU collectives across processes; gloo is jax 0.10's default, set it explicitly.
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(coordinator_address=f"127.0.0.1:{args.port}",
                               num_processes=args.num_processes,
                               process_id=args.process_id,
                               initialization_timeout=60)
    t0 = time.time()

    import numpy as np

    n = jax.device_count()
    assert jax.process_count() == args.num_processes, jax.process_count()
    assert n == args.num_processes * jax.local_device_count(), (n, jax.local_device_count())
    if args.mode == "fsdp":
        out = fsdp_steps(args.steps, n)
    else:
        out = zero2_steps(args.steps, n)
    os.makedirs(args.out, exist_ok=True)
    tmp = os.path.join(args.out, f"params_{args.process_id}.tmp.npz")
    np.savez(tmp, **out)
    os.replace(tmp, os.path.join(args.out, f"params_{args.process_id}.npz"))
    print(f"process {args.process_id}: {args.steps} {args.mode} steps on {n} devices "
          f"({jax.local_device_count()} local) in {time.time() - t0:.1f}s", flush=True)
    jax.distributed.shutdown()
    return 0


def zero2_steps(steps: int, n: int) -> dict:
    import jax
    import numpy as np
    import sharded_problem as sp
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    import muon_optax

    mesh = sp.make_mesh((n,))
    tx = sp.make_tx("data")
    host_params = sp.make_params()
    init, step, specs = sp.sharded_fns(tx, host_params, mesh)

    replicated = NamedSharding(mesh, P())
    params = jax.tree.map(lambda x: jax.make_array_from_process_local_data(replicated, x),
                          host_params)
    treedef = jax.tree.structure(host_params)
    paths = [muon_optax.path_str(p) for p, _ in
             jax.tree_util.tree_flatten_with_path(host_params)[0]]

    def global_grads(s):
        """Step ``s``'s gradients, ``(n, *shape)`` sharded over "data": device d's own
        gradient is row d, and this process makes only its own devices' rows."""
        def rows(path, index):
            start, stop, _ = index[0].indices(n)
            g = sp.device_grads(s, range(start, stop))
            return dict(zip(paths, jax.tree.leaves(g)))[path]

        return treedef.unflatten([
            jax.make_array_from_callback((n, *x.shape), NamedSharding(mesh, P("data")),
                                         lambda index, path=path: rows(path, index))
            for path, x in zip(paths, jax.tree.leaves(host_params))])

    state = init(params)
    compiled = step.lower(params, state, global_grads(0)).compile(sp.FAST_COMPILE)
    for s in range(steps):
        params, state = compiled(params, state, global_grads(s))

    out = {}
    for path, x in zip(paths, jax.tree.leaves(params)):
        assert x.is_fully_replicated, path
        out[path] = np.asarray(x.addressable_data(0))
    return out


def fsdp_steps(steps: int, n: int) -> dict:
    """The problem's params split over all devices of all processes (FSDP)."""
    import jax
    import numpy as np
    import optax
    import sharded_problem as sp
    from jax.experimental import multihost_utils
    from jax.sharding import AxisType, NamedSharding

    import muon_optax

    mesh = jax.make_mesh((n,), ("data",), axis_types=(AxisType.Explicit,))
    host_params = sp.make_params()
    specs = sp.fsdp_specs(host_params, n)
    tx = muon_optax.muon_adamw(sp.groups(), sp.LABELS, dimension_numbers=sp.DIMS,
                               axis_name="data", mesh=mesh)

    def put(tree):
        return jax.tree.map(lambda x, spec: jax.make_array_from_callback(
            x.shape, NamedSharding(mesh, spec), lambda index, x=x: x[index]), tree, specs)

    def apply(p, s, g):
        u, s = tx.update(g, s, p)
        return optax.apply_updates(p, u), s

    params = put(host_params)
    state = jax.jit(tx.init)(params)
    step = jax.jit(apply, compiler_options=sp.FAST_COMPILE)
    for s in range(steps):
        params, state = step(params, state, put(sp.mean_grads(sp.device_grads(s, range(4)),
                                                              np.float32)))
    gathered = multihost_utils.process_allgather(params, tiled=True)
    return {muon_optax.path_str(p): np.asarray(x)
            for p, x in jax.tree_util.tree_flatten_with_path(gathered)[0]}


if __name__ == "__main__":
    sys.exit(main())
