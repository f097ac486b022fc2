"""A small GPT in Flax NNX, modelled on the architecture of karpathy/nanochat.

Features (all following nanochat's design choices):

* token embedding followed by a parameter-free RMSNorm, no absolute position embedding;
* rotary position embeddings (half-split layout, base 10000) applied to queries and keys,
  then a parameter-free RMSNorm on queries and keys ("QK-norm");
* pre-norm residual blocks with parameter-free RMSNorm, causal self-attention and a
  ReLU^2 MLP with 4x expansion; no biases anywhere;
* learnable per-layer scalars: before block ``i`` the residual stream becomes
  ``resid_lambdas[i] * x + x0_lambdas[i] * x0`` where ``x0`` is the normalised embedding;
* an untied output head, float32 logits squashed by ``softcap * tanh(logits / softcap)``.

Features of nanochat left out for brevity: grouped-query attention, sliding-window
attention, value embeddings and the KV cache for generation.

Parameter layout: ``nnx.Linear`` kernels are stored as (in, out), the Flax convention.
The parameter paths (as joined with "/") are::

    wte/embedding                  (vocab, d)      AdamW  "embed"
    blocks/{i}/attn/c_q/kernel     (d, d)          Muon   "matrix"
    blocks/{i}/attn/c_k/kernel     (d, d)          Muon
    blocks/{i}/attn/c_v/kernel     (d, d)          Muon
    blocks/{i}/attn/c_proj/kernel  (d, d)          Muon
    blocks/{i}/mlp/c_fc/kernel     (d, 4d)         Muon
    blocks/{i}/mlp/c_proj/kernel   (4d, d)         Muon
    lm_head/kernel                 (d, vocab)      AdamW  "lm_head"
    resid_lambdas                  (n_layer,)      AdamW  "resid"
    x0_lambdas                     (n_layer,)      AdamW  "x0"

(``nnx.state`` adds a trailing ``/value`` to each of these.)
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

LOGIT_SOFTCAP = 15.0
ROPE_BASE = 10000.0


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    """Model shape. ``n_embd`` must be divisible by ``n_head``; head_dim must be even."""

    vocab_size: int = 256
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 256
    seq_len: int = 256

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd={self.n_embd} is not divisible by n_head={self.n_head}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for rotary embeddings")

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @classmethod
    def from_depth(
        cls,
        depth: int,
        vocab_size: int = 256,
        seq_len: int = 256,
        *,
        aspect_ratio: int = 64,
        head_dim: int = 64,
    ) -> GPTConfig:
        """Size a model from its depth alone, the way nanochat's base_train does.

        The width is ``depth * aspect_ratio`` rounded up to a whole number of heads of
        ``head_dim`` channels; the head count follows. nanochat uses aspect_ratio 64 and
        head_dim 128 (for GPUs). Here head_dim defaults to 64 so that small CPU models
        still get several heads: depth 4 -> n_embd 256, 4 heads of 64, 4 layers;
        depth 6 -> 384 / 6 heads; depth 8 -> 512 / 8 heads.
        """
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        width = depth * aspect_ratio
        n_embd = -(-width // head_dim) * head_dim
        return cls(
            vocab_size=vocab_size,
            n_layer=depth,
            n_head=n_embd // head_dim,
            n_embd=n_embd,
            seq_len=seq_len,
        )


def rms_norm(x: jax.Array, eps: float = 1e-6) -> jax.Array:
    """RMSNorm over the last axis with no learnable gain, computed in float32."""
    x32 = x.astype(jnp.float32)
    y = x32 * jax.lax.rsqrt(jnp.mean(jnp.square(x32), axis=-1, keepdims=True) + eps)
    return y.astype(x.dtype)


def rotary_tables(seq_len: int, head_dim: int, base: float = ROPE_BASE):
    """cos and sin tables of shape (seq_len, 1, head_dim // 2) for ``apply_rotary``."""
    inv_freq = base ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = jnp.arange(seq_len, dtype=jnp.float32)[:, None] * inv_freq[None, :]
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rotary(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """Rotate channel pairs (j, j + head_dim/2) of x, shaped (B, T, heads, head_dim)."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    cos, sin = cos.astype(x.dtype), sin.astype(x.dtype)
    return jnp.concatenate([x1 * cos + x2 * sin, x2 * cos - x1 * sin], axis=-1)


def _uniform(bound: float):
    """Initializer: uniform on [-bound, bound] (std bound / sqrt(3)); avoids outliers."""

    def init(key, shape, dtype=jnp.float32):
        return jax.random.uniform(key, shape, dtype, -bound, bound)

    return init


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.n_embd
        init = _uniform(math.sqrt(3.0 / d))  # std 1/sqrt(d), as nanochat
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.n_head = cfg.n_head
        self.head_dim = cfg.head_dim
        self.c_q = nnx.Linear(d, d, kernel_init=init, **dense)
        self.c_k = nnx.Linear(d, d, kernel_init=init, **dense)
        self.c_v = nnx.Linear(d, d, kernel_init=init, **dense)
        # Zero-initialised output projection: every block starts as the identity.
        self.c_proj = nnx.Linear(d, d, kernel_init=nnx.initializers.zeros, **dense)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        b, t, _ = x.shape
        heads = (b, t, self.n_head, self.head_dim)
        q = self.c_q(x).reshape(heads)
        k = self.c_k(x).reshape(heads)
        v = self.c_v(x).reshape(heads)
        q = rms_norm(apply_rotary(q, cos, sin))
        k = rms_norm(apply_rotary(k, cos, sin))
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)  # scale 1/sqrt(head_dim)
        return self.c_proj(y.reshape(b, t, -1))


class MLP(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, dtype, rngs: nnx.Rngs):
        d = cfg.n_embd
        dense = dict(use_bias=False, dtype=dtype, rngs=rngs)
        self.c_fc = nnx.Linear(d, 4 * d, kernel_init=_uniform(math.sqrt(3.0 / d)), **dense)
        self.c_proj = nnx.Linear(4 * d, d, kernel_init=nnx.initializers.zeros, **dense)

    def __call__(self, x: jax.Array) -> jax.Array:
        return self.c_proj(jnp.square(jax.nn.relu(self.c_fc(x))))


class Block(nnx.Module):
    def __init__(self, cfg: GPTConfig, *, dtype, rngs: nnx.Rngs):
        self.attn = CausalSelfAttention(cfg, dtype=dtype, rngs=rngs)
        self.mlp = MLP(cfg, dtype=dtype, rngs=rngs)

    def __call__(self, x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
        x = x + self.attn(rms_norm(x), cos, sin)
        return x + self.mlp(rms_norm(x))


class GPT(nnx.Module):
    """Decoder-only transformer; ``model(tokens)`` maps (B, T) int32 to (B, T, V) float32.

    ``dtype`` is the compute dtype of the matmuls (e.g. ``jnp.bfloat16`` on GPU);
    parameters are always stored in float32.
    """

    def __init__(self, cfg: GPTConfig, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.cfg = cfg
        self.wte = nnx.Embed(
            cfg.vocab_size,
            cfg.n_embd,
            embedding_init=nnx.initializers.normal(stddev=1.0),
            dtype=dtype,
            rngs=rngs,
        )
        self.blocks = nnx.List([Block(cfg, dtype=dtype, rngs=rngs) for _ in range(cfg.n_layer)])
        self.lm_head = nnx.Linear(
            cfg.n_embd,
            cfg.vocab_size,
            use_bias=False,
            kernel_init=nnx.initializers.normal(stddev=0.001),
            dtype=dtype,
            rngs=rngs,
        )
        # Scale of the residual stream and weight of the embedding shortcut, per layer.
        self.resid_lambdas = nnx.Param(jnp.ones((cfg.n_layer,), jnp.float32))
        self.x0_lambdas = nnx.Param(jnp.full((cfg.n_layer,), 0.1, jnp.float32))

    def __call__(self, tokens: jax.Array) -> jax.Array:
        t = tokens.shape[-1]
        if t > self.cfg.seq_len:
            raise ValueError(f"sequence of {t} tokens exceeds seq_len={self.cfg.seq_len}")
        cos, sin = rotary_tables(t, self.cfg.head_dim)
        x = rms_norm(self.wte(tokens))
        x0 = x
        resid = self.resid_lambdas[...]
        skip = self.x0_lambdas[...]
        for i, block in enumerate(self.blocks):
            x = resid[i].astype(x.dtype) * x + skip[i].astype(x.dtype) * x0
            x = block(x, cos, sin)
        logits = self.lm_head(rms_norm(x)).astype(jnp.float32)
        return LOGIT_SOFTCAP * jnp.tanh(logits / LOGIT_SOFTCAP)


def loss_fn(model: GPT, x: jax.Array, y: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy (nats per token), in float32."""
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()


def count_params(model: GPT) -> int:
    return sum(p.size for p in jax.tree_util.tree_leaves(nnx.state(model, nnx.Param)))
