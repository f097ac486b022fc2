"""The public constructors: nanochat's MuonAdamW, and Muon and AdamW alone, all the same
engine with other groups (so they shard alike and their states have one form)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import jax
import optax

from muon_optax.plan.specs import owner_axes
from muon_optax.rule.hparams import AdamWConfig, MuonConfig, Scalar, parse_groups
from muon_optax.state.init import Init
from muon_optax.step.engine import Options, local_fns
from muon_optax.step.guard import check_options
from muon_optax.step.jit_mode import wrap_in_shard_map

SMALL_PARAM_THRESHOLD = 1024


def build(configs: Mapping[str, AdamWConfig | MuonConfig], param_labels: Any, name: str,
          dimension_numbers: Any, axis_name: Any, mesh: jax.sharding.Mesh | None,
          param_specs: Any, max_grad_norm: Any, skip_nonfinite: bool,
          small_param_threshold: int = SMALL_PARAM_THRESHOLD) -> optax.GradientTransformation:
    """The engine as an optax transformation, for any groups (every constructor's)."""
    axes = owner_axes(axis_name, mesh, name)
    if isinstance(small_param_threshold, bool) or not isinstance(small_param_threshold, int):
        raise TypeError("small_param_threshold must be an int (elements).")
    max_grad_norm = check_options(max_grad_norm, skip_nonfinite, name)
    opts = Options(dict(configs), param_labels, dimension_numbers, axes, mesh,
                   param_specs, small_param_threshold, name, max_grad_norm, skip_nonfinite)
    init_fn, update_fn = wrap_in_shard_map(opts) if mesh is not None else local_fns(opts)
    return optax.GradientTransformation(Init(init_fn, opts), update_fn)


def muon_adamw(
    groups: Mapping[str, Mapping[str, Any]],
    param_labels: Any,
    *,
    dimension_numbers: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    small_param_threshold: int = SMALL_PARAM_THRESHOLD,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformation:
    """nanochat's MuonAdamW: AdamW and Muon parameter groups in one transformation.

    Args:
      groups: group name -> a dict as nanochat's ``param_groups`` without ``params``
        (``rule/hparams.py``): ``kind`` (``"adamw"``/``"muon"``), ``lr``, optionally the
        arguments of :func:`muon_optax.adamw`/``muon`` (same defaults); scalars may be schedules.
      param_labels: the params' tree with a group name at every leaf, or a callable
        params -> such a tree (see :func:`muon_optax.label_by_path`).
      dimension_numbers: a Muon leaf's input and output axes (and blocks), as
        :class:`muon_optax.MuonDimensionNumbers`: one for all, a tree, or a callable.
        Default: the last two axes ``(in, out)`` (Flax), leading axes batch (a scanned
        ``(L, in, out)`` is L matrices); PyTorch's: ``(reduction_axis=1, output_axis=0)``.
      axis_name: the mesh axis (or tuple of axes) whose devices own the Muon matrices.
        Without ``mesh``: ZeRO-2 inside your ``jax.shard_map``, where ``init`` and
        ``update`` run, the params whole on every device, and ``update`` takes each
        device's own, unreduced gradients (see :func:`muon_optax.state_specs`).
      mesh: with ``axis_name``, for plain ``jax.jit`` steps on params laid out in any way
        (replicated, FSDP, tensor parallel, 2-D): each Muon matrix moves whole to its owner
        and its direction back (all-to-all), AdamW params update where they lie, the state
        is split over ``axis_name``; the gradients are the usual (averaged) ones.
      param_specs: with ``mesh``, the params' layouts: a tree of ``PartitionSpec`` or
        ``NamedSharding`` (``nnx.Variable`` boxes accepted), a callable params -> such a
        tree, or one ``PartitionSpec`` for all. Needed (else tracing raises) only under
        ``jax.jit`` on Auto axes when ``init`` did not see the placed params eagerly.
      small_param_threshold: under ``axis_name``, AdamW params whole on every device with
        fewer elements are all-reduced and replicated instead of split.
      max_grad_norm: scale the mean gradient ``g`` by ``min(1, max_grad_norm / ||g||)``
        (norm over all leaves; None: no clipping), as ``optax.clip_by_global_norm`` on the
        global batch, in every mode (chained before ZeRO-2, it would see one device's).
      skip_nonfinite: a step whose mean gradient has a NaN or inf returns zero updates and
        the state unchanged (``count`` too) on every device; ``state.skipped`` counts
        such steps (in a chain, in this transformation's part: ``state[1].skipped``).

    Returns:
      An ``optax.GradientTransformation`` (:class:`MuonAdamWState`); ``update`` needs params.
    """
    if isinstance(small_param_threshold, jax.Array):
        raise TypeError(  # optax.inject_hyperparams(muon_adamw) found only this argument
            "muon_adamw: optax.inject_hyperparams has nothing to inject here: the hyperparameters "
            "live in the groups dict (it took small_param_threshold for one). Make a group's "
            "values optax schedules instead, e.g. dict(kind='muon', "
            "lr=optax.cosine_decay_schedule(0.02, 1000)), which current_hyperparams(tx, state) "
            "reads back; or inject into muon_optax.muon / adamw inside optax.partition.")
    return build(parse_groups(groups), param_labels, "muon_adamw", dimension_numbers, axis_name,
                 mesh, param_specs, max_grad_norm, skip_nonfinite, small_param_threshold)


def muon(
    lr: Scalar,
    momentum: Scalar = 0.95,
    ns_steps: int = 5,
    beta2: Scalar = 0.95,
    weight_decay: Scalar = 0.0,
    *,
    row_equilibration: bool = True,
    renormalize: bool = True,
    compute_dtype: Any = None,
    polar_method: str = "auto",
    dimension_numbers: Any = None,
    ns_coeffs: Any = "polar_express",
    nesterov: bool = True,
    normuon: bool = True,
    cautious: bool = True,
    preconditioning: str = "basin",
    mu_dtype: Any = None,
    axis_name: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformation:
    """Muon on every leaf (each of two or more axes) as nanochat computes it, alone or
    inside ``optax.partition``; :func:`muon_optax.muon_adamw`'s Muon groups alike.

    Args:
      lr: learning rate; a matrix with more rows than columns (out > in) gets ``lr sqrt(out / in)``.
      momentum: Nesterov momentum coefficient.
      ns_steps: polar iterations (static): 1..5 with Polar Express.
      beta2: decay rate of NorMuon's factored second moment.
      weight_decay: cautious decoupled weight decay, multiplied by ``lr``.
      row_equilibration: MuonEq row scaling before the polar iteration.
      renormalize: Muon+ rescaling of the polar factor to norm ``sqrt(min(R, C))``.
      compute_dtype: dtype of the polar iteration (default float32 on CPU, bfloat16 elsewhere).
      polar_method: ``"auto"`` (a float32 rectangular matrix's last steps in Gram space where
        that saves FLOPs: ``rule/polar.py``), ``"direct"`` (as written) or ``"gram"`` (all).
      dimension_numbers: as in :func:`muon_optax.muon_adamw`.
      ns_coeffs: each iteration's polynomial: ``"polar_express"`` (default; the first
        ``ns_steps`` of its five triples), ``"quintic"`` (Keller Jordan's ``(3.4445,
        -4.7750, 2.0315)`` every step; any ``ns_steps``), a triple ``(a, b, c)`` (every
        step), or an ``(n, 3)`` table (its first ``ns_steps`` rows).
      nesterov: Nesterov momentum ``lerp(g, buf, momentum)`` (default); False: the buffer.
      normuon: NorMuon's variance reduction (default on).
      cautious: decay only where update and weight agree in sign (default); False: ``-lr_eff wd P``.
      preconditioning: ``"basin"`` (``X / (1.01 ||X||_F + 1e-6)``, after MuonEq), ``"aol"``
        (Turbo-Muon's row scaling in the first iteration; may save one), or optax's
        ``"frobenius"``, ``"spectral"``, ``"schatten"``.
      mu_dtype: dtype of the momentum buffer (default: the parameter's).
      axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite: as in
        :func:`muon_optax.muon_adamw` (in ``optax.partition``, seeing its leaves only).

    Returns:
      An ``optax.GradientTransformation``; ``update`` needs ``params``.
    """
    cfg = MuonConfig.make(lr, momentum, ns_steps, beta2, weight_decay, row_equilibration,
                          renormalize, compute_dtype, polar_method, ns_coeffs=ns_coeffs,
                          nesterov=nesterov, normuon=normuon, cautious=cautious,
                          preconditioning=preconditioning, mu_dtype=mu_dtype, where="muon")
    return build({"muon": cfg}, lambda params: jax.tree.map(lambda _: "muon", params), "muon",
                 dimension_numbers, axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite)


def adamw(
    lr: Scalar,
    betas: tuple[Scalar, Scalar] = (0.9, 0.999),
    eps: Scalar = 1e-8,
    weight_decay: Scalar = 0.0,
    *,
    axis_name: str | tuple[str, ...] | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    max_grad_norm: float | None = None,
    skip_nonfinite: bool = False,
) -> optax.GradientTransformation:
    """AdamW on every leaf with nanochat's hyperparameter names, alone or inside ``optax.partition``
    (:func:`muon_optax.muon_adamw`'s AdamW groups alike). Each scalar may be an optax schedule.

    Args:
      lr: learning rate.
      betas: ``(b1, b2)``, the decay rates of the first and second moments.
      eps: added to the root of the second moment.
      weight_decay: decoupled decay, multiplied by ``lr``; needs ``params`` in ``update``.
      axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite: as in :func:`muon_adamw` (no
        ``small_param_threshold``: ``optax.inject_hyperparams`` sees only hyperparameters).

    Returns:
      An ``optax.GradientTransformation`` whose state is ``MuonAdamWState``.
    """
    cfg = AdamWConfig.make(lr, betas, eps, weight_decay, where="adamw")
    return build({"adamw": cfg}, lambda params: jax.tree.map(lambda _: "adamw", params), "adamw",
                 None, axis_name, mesh, param_specs, max_grad_norm, skip_nonfinite)
