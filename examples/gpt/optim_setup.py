"""nanochat's optimizer setup for the GPT example, expressed with ``muon_optax``.

Groups (``GPT.setup_optimizer`` in nanochat's ``nanochat/gpt.py``):

=========  ======  ====================================  ============  =====  ============
group      kind    lr                                    betas         eps    weight_decay
=========  ======  ====================================  ============  =====  ============
lm_head    AdamW   unembedding_lr * (d_model/768)^-0.5   (0.8, 0.95)   1e-10  0
embed      AdamW   embedding_lr * (d_model/768)^-0.5     (0.8, 0.95)   1e-10  0
resid      AdamW   scalar_lr * 0.01                      (0.8, 0.95)   1e-10  0
x0         AdamW   scalar_lr                             (0.96, 0.95)  1e-10  0
matrix     Muon    matrix_lr, momentum 0.95 (scheduled), ns_steps 5, beta2 0.95,
                   weight_decay (scheduled)
=========  ======  ====================================  ============  =====  ============

Schedules (``scripts/base_train.py`` in nanochat), all functions of the optimizer step:

* every group's lr is multiplied by ``lr_multiplier``: linear warmup over
  ``warmup_steps`` (``(step + 1) / warmup_steps``), then 1, then over the last
  ``warmdown_frac`` of the run a linear ramp down to ``final_lr_frac``;
* Muon momentum rises linearly from 0.85 to 0.97 over the first ``momentum_warmup_steps``
  (400 in nanochat; here ``min(400, total_steps // 3)`` by default, so that short runs
  reach it too), stays at 0.97, and falls linearly to 0.90 during the lr warmdown;
* Muon weight decay follows a cosine from ``weight_decay`` at step 0 to zero at the end.

Default base values are nanochat's base_train defaults: embedding_lr 0.3,
unembedding_lr 0.008, matrix_lr 0.02, scalar_lr 0.5, weight_decay 0.28, warmup 40 steps,
warmdown_frac 0.65, final_lr_frac 0.05. nanochat further rescales all lrs by
``sqrt(tokens_per_step / 2**19)`` and the weight decay by its token-horizon rule; that
scaling is offered as ``nanochat_batch_lr_scale`` and the ``lr_scale`` argument but is
off by default (tiny CPU batches would get ~16x smaller lrs).
"""

from __future__ import annotations

import math
import re
from typing import Any

import jax
import jax.numpy as jnp
import optax

import muon_optax

ADAM_BETAS = (0.8, 0.95)
ADAM_EPS = 1e-10
REFERENCE_D_MODEL = 768  # width at which nanochat tuned the AdamW lrs
REFERENCE_BATCH_TOKENS = 2**19  # nanochat's reference batch size, in tokens

# (regex on the "/"-joined parameter path, group); first match wins.
LABEL_RULES = (
    (r"^wte/", "embed"),
    (r"^lm_head/", "lm_head"),
    (r"^resid_lambdas", "resid"),
    (r"^x0_lambdas", "x0"),
    (r"^blocks/\d+/(attn|mlp)/\w+/kernel", "matrix"),
)
GROUP_NAMES = ("lm_head", "embed", "resid", "x0", "matrix")
# --muon-blocks: which attention kernels are cut into head blocks, and on which side.
_HEAD_OUTPUTS = r"^blocks/\d+/attn/(c_q|c_k|c_v)/kernel"   # (d, heads * head_dim)
_HEAD_INPUTS = r"^blocks/\d+/attn/c_proj/kernel"           # (heads * head_dim, d)


def block_axes(path: str, n_head: int, heads_per_block: int | None) -> dict[int, int]:
    """``{axis: blocks}`` of the kernel at ``path`` under ``--muon-blocks``: the
    attention projections cut into blocks of ``heads_per_block`` heads (``c_q``/``c_k``/
    ``c_v`` on their output axis 1, ``c_proj`` on its input axis 0); ``{}`` elsewhere,
    and everywhere for None (nanochat's rule: every kernel one matrix)."""
    if heads_per_block is None:
        return {}
    if n_head % heads_per_block:
        raise ValueError(f"{heads_per_block} heads per block do not divide the model's "
                         f"{n_head} heads")
    blocks = n_head // heads_per_block
    if re.search(_HEAD_OUTPUTS, path):
        return {1: blocks}
    return {0: blocks} if re.search(_HEAD_INPUTS, path) else {}


def block_dimension_numbers(params, n_head: int, heads_per_block: int | None) -> Any:
    """``dimension_numbers`` for ``--muon-blocks`` (:func:`block_axes`): every block its
    own Muon matrix. None for nanochat's rule."""
    if heads_per_block is None:
        return None

    def dims(path, _):
        axes = block_axes(muon_optax.path_str(path), n_head, heads_per_block)
        if not axes:
            return None
        return muon_optax.MuonDimensionNumbers(0, 1, reduction_blocks=axes.get(0, 1),
                                               output_blocks=axes.get(1, 1))
    return jax.tree_util.tree_map_with_path(dims, params)


def lr_multiplier(
    total_steps: int, warmup_steps: int, warmdown_frac: float, final_lr_frac: float
) -> optax.Schedule:
    """Warmup -> constant -> linear warmdown to ``final_lr_frac`` (nanochat's shape)."""
    warmdown_steps = round(warmdown_frac * total_steps)
    warmup = max(warmup_steps, 1)
    warmdown = max(warmdown_steps, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        progress = (total_steps - step) / warmdown  # 1 at warmdown start, 0 at the end
        decay = progress + (1.0 - progress) * final_lr_frac
        return jnp.where(
            step < warmup_steps,
            (step + 1.0) / warmup,
            jnp.where(step <= total_steps - warmdown_steps, 1.0, decay),
        )

    return schedule


def muon_momentum(
    total_steps: int,
    warmdown_frac: float,
    momentum_warmup_steps: int,
    start: float = 0.85,
    peak: float = 0.97,
    end: float = 0.90,
) -> optax.Schedule:
    """``start -> peak`` over the warmup, ``peak``, then ``peak -> end`` over the warmdown."""
    warmdown_steps = round(warmdown_frac * total_steps)
    warmdown_start = total_steps - warmdown_steps
    warmup = max(momentum_warmup_steps, 1)
    warmdown = max(warmdown_steps, 1)

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        frac = step / warmup
        rising = (1.0 - frac) * start + frac * peak
        progress = (step - warmdown_start) / warmdown
        falling = (1.0 - progress) * peak + progress * end
        return jnp.where(
            step < momentum_warmup_steps,
            rising,
            jnp.where(step >= warmdown_start, falling, peak),
        )

    return schedule


def cosine_weight_decay(weight_decay: float, total_steps: int) -> optax.Schedule:
    """``weight_decay * (1 + cos(pi * step / total_steps)) / 2``: full at 0, zero at the end."""

    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        return weight_decay * 0.5 * (1.0 + jnp.cos(math.pi * step / total_steps))

    return schedule


def _times(base: float, multiplier: optax.Schedule) -> optax.Schedule:
    return lambda step: base * multiplier(step)


def nanochat_batch_lr_scale(tokens_per_step: int) -> float:
    """nanochat's lr correction for the batch size: ``sqrt(B / 2**19)`` with B in tokens."""
    return math.sqrt(tokens_per_step / REFERENCE_BATCH_TOKENS)


def default_momentum_warmup_steps(total_steps: int) -> int:
    return max(1, min(400, total_steps // 3))


def make_groups(
    d_model: int,
    *,
    total_steps: int,
    warmup_steps: int = 40,
    warmdown_frac: float = 0.65,
    final_lr_frac: float = 0.05,
    embedding_lr: float = 0.3,
    unembedding_lr: float = 0.008,
    matrix_lr: float = 0.02,
    scalar_lr: float = 0.5,
    weight_decay: float = 0.28,
    lr_scale: float = 1.0,
    momentum_warmup_steps: int | None = None,
    muon_options: dict[str, Any] | None = None,
    schedules: bool = True,
) -> dict[str, dict[str, Any]]:
    """The group dicts for ``muon_optax.muon_adamw`` (see the module docstring).

    With ``schedules=False`` every hyperparameter is its constant base value (handy for
    printing the setup).
    """
    if total_steps < 1:
        raise ValueError(f"total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= warmdown_frac <= 1.0:
        raise ValueError(f"warmdown_frac must be in [0, 1], got {warmdown_frac}")
    if momentum_warmup_steps is None:
        momentum_warmup_steps = default_momentum_warmup_steps(total_steps)
    dmodel_scale = (d_model / REFERENCE_D_MODEL) ** -0.5
    base_lrs = {
        "lm_head": unembedding_lr * dmodel_scale * lr_scale,
        "embed": embedding_lr * dmodel_scale * lr_scale,
        "resid": scalar_lr * 0.01 * lr_scale,
        "x0": scalar_lr * lr_scale,
        "matrix": matrix_lr * lr_scale,
    }
    if schedules:
        mult = lr_multiplier(total_steps, warmup_steps, warmdown_frac, final_lr_frac)
        lrs = {name: _times(lr, mult) for name, lr in base_lrs.items()}
        momentum = muon_momentum(total_steps, warmdown_frac, momentum_warmup_steps)
        wd = cosine_weight_decay(weight_decay, total_steps)
    else:
        lrs, momentum, wd = base_lrs, 0.95, weight_decay

    def adamw(name, betas=ADAM_BETAS):
        return dict(kind="adamw", lr=lrs[name], betas=betas, eps=ADAM_EPS, weight_decay=0.0)

    return {
        "lm_head": adamw("lm_head"),
        "embed": adamw("embed"),
        "resid": adamw("resid"),
        "x0": adamw("x0", betas=(0.96, 0.95)),  # nanochat: higher beta1 for x0_lambdas
        "matrix": dict(
            kind="muon",
            lr=lrs["matrix"],
            momentum=momentum,
            ns_steps=5,
            beta2=0.95,
            weight_decay=wd,
            **(muon_options or {}),
        ),
    }


def param_labels(params) -> Any:
    """The group name of every parameter (a pytree like ``params``)."""
    return muon_optax.label_by_path(LABEL_RULES, matrix="unmatched", other="unmatched")(params)


def check_labels(params) -> dict[str, int]:
    """Checks that every parameter has a group and Muon sees only matrices.

    Returns the number of parameter values (not arrays) in each group.
    """
    labels = param_labels(params)
    counts = dict.fromkeys(GROUP_NAMES, 0)
    flat = jax.tree_util.tree_flatten_with_path(params)[0]
    for (path, leaf), label in zip(flat, jax.tree_util.tree_leaves(labels)):
        name = "/".join(str(getattr(k, "key", getattr(k, "name", k))) for k in path)
        if label not in counts:
            raise ValueError(f"parameter {name} {tuple(leaf.shape)} matches no optimizer group")
        if label == "matrix" and leaf.ndim != 2:
            raise ValueError(f"Muon parameter {name} has shape {tuple(leaf.shape)}, not 2-D")
        counts[label] += math.prod(leaf.shape)
    empty = [g for g, n in counts.items() if n == 0]
    if empty:
        raise ValueError(f"optimizer groups without parameters: {empty}")
    return counts


def make_optimizer(
    params,
    cfg,
    *,
    total_steps: int,
    axis_name: str | None = None,
    mesh: jax.sharding.Mesh | None = None,
    param_specs: Any = None,
    heads_per_block: int | None = None,
    **group_settings: Any,
) -> optax.GradientTransformation:
    """nanochat's MuonAdamW for a ``model.GPT`` with config ``cfg``.

    ``params`` is the model's parameter pytree (e.g. ``nnx.state(model, nnx.Param)``),
    used here only to check the grouping. ``group_settings`` are :func:`make_groups`'
    keywords (learning rates, schedule shape, ``muon_options`` such as
    ``dict(compute_dtype=jnp.bfloat16)``); ``axis_name`` selects the sharded variant of
    ``muon_optax.muon_adamw`` (ZeRO-2 inside ``shard_map``), with ``mesh`` and
    ``param_specs`` (the params' PartitionSpecs on that mesh of auto axes) the one for
    plain ``jax.jit`` over params laid out as ``param_specs`` say (FSDP).
    ``heads_per_block``: Muon on blocks of that many heads of the attention kernels
    (see :func:`block_dimension_numbers`); None is nanochat's rule.
    """
    check_labels(params)
    groups = make_groups(cfg.n_embd, total_steps=total_steps, **group_settings)
    labels = muon_optax.label_by_path(LABEL_RULES, matrix="unmatched", other="unmatched")
    return muon_optax.muon_adamw(
        groups, labels, axis_name=axis_name, mesh=mesh, param_specs=param_specs,
        dimension_numbers=block_dimension_numbers(params, cfg.n_head, heads_per_block))
