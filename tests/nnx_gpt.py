"""A new user's Flax NNX GPT, built from Flax's standard modules, for the nnx tests.

Not collected (no ``test_`` prefix). ``nnx.Embed`` table, per block ``nnx.LayerNorm``,
``nnx.MultiHeadAttention`` (``LinearGeneral`` kernels ``(in, heads, head_dim)`` and
``(heads, head_dim, out)``), ``nnx.RMSNorm`` and a two-layer MLP, and an ``lm_head``
``nnx.Linear``: what Flax's guides build, with nothing named for this library.
"""

from __future__ import annotations

import jax
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import muon_optax

VOCAB, D, HEADS, LAYERS, SEQ = 64, 32, 4, 2, 8


def _init(partitioned: bool, names: tuple, init=nnx.initializers.lecun_normal()):
    """``init``, with FSDP sharding metadata (``nnx.with_partitioning``) if asked."""
    return nnx.with_partitioning(init, names) if partitioned else init


class Block(nnx.Module):
    def __init__(self, rngs: nnx.Rngs, partitioned: bool = False):
        self.ln1 = nnx.LayerNorm(D, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(
            num_heads=HEADS, in_features=D, decode=False, rngs=rngs,
            kernel_init=_init(partitioned, ("data", None, None)),
            out_kernel_init=_init(partitioned, (None, None, "data")))
        self.ln2 = nnx.RMSNorm(D, rngs=rngs)
        self.fc = nnx.Linear(D, 4 * D, rngs=rngs, kernel_init=_init(partitioned, ("data", None)))
        self.proj = nnx.Linear(4 * D, D, rngs=rngs,
                               kernel_init=_init(partitioned, ("data", None)))

    def __call__(self, x):
        x = x + self.attn(self.ln1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.proj(jax.nn.gelu(self.fc(self.ln2(x))))


class GPT(nnx.Module):
    """``partitioned``: FSDP metadata on the matrices (create under ``jax.set_mesh``)."""

    def __init__(self, rngs: nnx.Rngs, partitioned: bool = False):
        self.embed = nnx.Embed(VOCAB, D, rngs=rngs, embedding_init=_init(
            partitioned, ("data", None), nnx.initializers.normal(1.0)))
        self.blocks = nnx.List([Block(rngs, partitioned) for _ in range(LAYERS)])
        self.lm_head = nnx.Linear(D, VOCAB, use_bias=False, rngs=rngs,
                                  kernel_init=_init(partitioned, ("data", None)))

    def __call__(self, tokens):
        x = self.embed(tokens)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(x)


GROUPS = {"adamw": dict(kind="adamw", lr=3e-3, betas=(0.8, 0.95), eps=1e-10,
                        weight_decay=0.0),
          "muon": dict(kind="muon", lr=0.02, momentum=0.95, ns_steps=5, beta2=0.95,
                       weight_decay=0.1)}


def loss_fn(model: GPT, tokens: jax.Array) -> jax.Array:
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()


@nnx.jit
def train_step(model: GPT, optimizer: nnx.Optimizer, tokens: jax.Array) -> jax.Array:
    loss, grads = nnx.value_and_grad(loss_fn)(model, tokens)
    optimizer.update(model, grads)
    return loss


def tokens(batch: int = 8, seed: int = 0) -> jax.Array:
    return jax.random.randint(jax.random.PRNGKey(seed), (batch, SEQ + 1), 0, VOCAB)


def fsdp_spec(x: jax.Array, mesh: jax.sharding.Mesh, tp: bool = False) -> P:
    """FSDP: the first axis that ``"data"`` divides is split over it; with ``tp``, the
    last other axis that ``"model"`` divides over that (tensor parallel)."""
    spec: list = [None] * x.ndim
    for axis in range(x.ndim):
        if x.shape[axis] % mesh.shape["data"] == 0 and x.size >= 256:
            spec[axis] = "data"
            break
    if tp:
        for axis in reversed(range(x.ndim)):
            if spec[axis] is None and x.shape[axis] % mesh.shape["model"] == 0 \
                    and x.size >= 256:
                spec[axis] = "model"
                break
    return P(*spec)


def place(model: GPT, mesh: jax.sharding.Mesh, tp: bool = False) -> dict:
    """Places the model's params FSDP (and TP) over ``mesh``, in place; returns the
    params' PartitionSpecs (pure tree)."""
    state = nnx.state(model, nnx.Param)
    specs = jax.tree.map(lambda x: fsdp_spec(x, mesh, tp), nnx.as_pure(state))
    nnx.update(model, jax.tree.map(lambda x, s: jax.device_put(x, NamedSharding(mesh, s)),
                                   nnx.as_pure(state), specs))
    return specs


def optimizer_collectives(tx, optimizer: nnx.Optimizer, model: GPT, n: int) -> dict:
    """The collectives of ``tx.update`` alone, compiled as ``nnx.Optimizer`` calls it
    (params, grads laid out like them, the optimizer's state)."""
    from sharded_problem import collectives

    params = nnx.as_pure(nnx.state(model, nnx.Param))
    state = nnx.as_pure(optimizer.opt_state)
    step = jax.jit(lambda g, s, p: tx.update(g, s, p))
    return collectives(step.lower(params, state, params).compile().as_text(), n)


def attention_dims(heads: int, blocked: bool = True):
    """Per-head Muon blocks of nnx.MultiHeadAttention's kernels (docs/options.md), or (the
    reference) their heads axis as a batch axis: a callable for ``dimension_numbers``."""
    D = muon_optax.MuonDimensionNumbers

    def dims(path, _):
        name = muon_optax.path_str(path)
        if any(f"{k}/kernel" in name for k in ("query", "key", "value")):
            return D(0, (1, 2), output_blocks=heads) if blocked else D(0, 2)
        if "out/kernel" in name:
            return D((0, 1), 2, reduction_blocks=heads) if blocked else D(1, 2)
        return None
    return lambda params: jax.tree_util.tree_map_with_path(dims, params)


def make_tx(**kwargs) -> optax.GradientTransformation:
    return muon_optax.muon_adamw(GROUPS, muon_optax.label_by_path(), **kwargs)
