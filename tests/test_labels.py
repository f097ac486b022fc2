"""label_by_path's default on Flax models: names before ranks."""

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from flax import nnx

import muon_optax


def labelled(tree, labels=None):
    labels = muon_optax.label_by_path() if labels is None else labels
    flat = jax.tree_util.tree_flatten_with_path(labels(tree))[0]
    return {muon_optax.path_str(p): label for p, label in flat}


class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.LayerNorm()(x)
        h = nn.DenseGeneral((4, 8))(h)             # kernel (16, 4, 8), bias (4, 8)
        return x + nn.Dense(16)(h.reshape(h.shape[:-2] + (32,))), None


class LinenScanned(nn.Module):
    @nn.compact
    def __call__(self, x):
        stack = nn.scan(LinenBlock, variable_axes={"params": 0}, split_rngs={"params": True},
                        length=3)
        return stack()(x, None)[0]


def test_linen_scanned_biases_and_scales_go_to_other():
    params = LinenScanned().init(jax.random.PRNGKey(0), jnp.ones((2, 16)))["params"]
    shapes = {muon_optax.path_str(p): x.shape
              for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    block = "ScanLinenBlock_0"
    assert shapes[f"{block}/LayerNorm_0/scale"] == (3, 16)
    assert shapes[f"{block}/DenseGeneral_0/bias"] == (3, 4, 8)
    assert labelled(params) == {
        f"{block}/LayerNorm_0/scale": "adamw", f"{block}/LayerNorm_0/bias": "adamw",
        f"{block}/DenseGeneral_0/kernel": "muon", f"{block}/DenseGeneral_0/bias": "adamw",
        f"{block}/Dense_0/kernel": "muon", f"{block}/Dense_0/bias": "adamw"}


class NnxBlock(nnx.Module):
    def __init__(self, rngs):
        self.linear = nnx.Linear(8, 8, rngs=rngs)
        self.norm = nnx.LayerNorm(8, rngs=rngs)
        self.rms = nnx.RMSNorm(8, rngs=rngs)


class NnxModel(nnx.Module):
    def __init__(self, rngs):
        self.wte = nnx.Embed(10, 8, rngs=rngs)

        @nnx.vmap(in_axes=0, out_axes=0)
        def make(key):
            return NnxBlock(nnx.Rngs(key))

        self.layers = make(jax.random.split(rngs.params(), 3))
        self.logit_scale = nnx.Param(jnp.ones((1, 1)))


@pytest.mark.parametrize("pure", [False, True])
def test_nnx_scanned_layers_and_embedding(pure):
    state = nnx.state(NnxModel(nnx.Rngs(0)), nnx.Param)
    if pure:
        state = nnx.as_pure(state)
    assert labelled(state) == {
        "wte/embedding": "adamw", "logit_scale": "adamw",
        "layers/linear/kernel": "muon", "layers/linear/bias": "adamw",
        "layers/norm/scale": "adamw", "layers/norm/bias": "adamw",
        "layers/rms/scale": "adamw"}


def test_names_and_ranks_in_plain_trees():
    tree = {"bias": jnp.ones((3, 4)), "q_bias": jnp.ones((3, 4)), "Scale": jnp.ones((3, 4)),
            "pos_embed": jnp.ones((16, 8)), "embeddings": jnp.ones((16, 8)),
            "kernel": jnp.ones((4, 8)), "weight": jnp.ones((2, 4, 8)), "w": jnp.ones((4, 8)),
            "unbiased": jnp.ones((4, 8)), "gain": jnp.ones(8), "kernel_1d": jnp.ones(8)}
    got = labelled(tree, muon_optax.label_by_path(matrix="m", other="o"))
    assert got == {"bias": "o", "q_bias": "o", "Scale": "o", "pos_embed": "o",
                   "embeddings": "o", "kernel": "m", "weight": "m", "w": "m",
                   "unbiased": "m", "gain": "o", "kernel_1d": "o"}


def test_rules_come_before_names():
    tree = {"wte": {"embedding": jnp.ones((16, 8))}, "attn": {"bias": jnp.ones((4, 8))}}
    labels = muon_optax.label_by_path([("attn/bias", "muon"), ("wte", "embed")])
    assert labelled(tree, labels) == {"wte/embedding": "embed", "attn/bias": "muon"}


def test_embeddings_and_heads_go_to_other_by_module_name():
    """Leaves under an embedding or an output head, as nanochat groups them; names that
    only contain the words (``heads``, ``multihead``) are matrices."""
    tree = {"lm_head": {"kernel": jnp.ones((8, 16))}, "head": jnp.ones((8, 4)),
            "cls_head": {"w": jnp.ones((8, 2))}, "unembed": {"kernel": jnp.ones((8, 16))},
            "tok_embeddings": {"weight": jnp.ones((16, 8))}, "wpe": jnp.ones((4, 8)),
            "value_embeds": {"0": jnp.ones((16, 8))},
            "attn": {"heads": {"kernel": jnp.ones((8, 8))},
                     "multihead": {"kernel": jnp.ones((8, 8))}}}
    assert labelled(tree) == {
        "lm_head/kernel": "adamw", "head": "adamw", "cls_head/w": "adamw",
        "unembed/kernel": "adamw", "tok_embeddings/weight": "adamw", "wpe": "adamw",
        "value_embeds/0": "adamw", "attn/heads/kernel": "muon",
        "attn/multihead/kernel": "muon"}
    rules = muon_optax.label_by_path([("lm_head", "muon")])
    assert labelled(tree, rules)["lm_head/kernel"] == "muon"   # a rule overrides the name


def _tutorial_tree(mlp_width=256, layers=2, vocab=1000, d=64):
    """The JAX AI stack's miniGPT naming: no 'head' anywhere, the head is output_layer."""
    s = lambda *shape: jax.ShapeDtypeStruct(shape, jnp.float32)  # noqa: E731
    block = {"mha": {"query": {"kernel": s(d, 4, 16)}, "out": {"kernel": s(4, 16, d)}},
             "linear1": {"kernel": s(d, mlp_width), "bias": s(mlp_width)},
             "linear2": {"kernel": s(mlp_width, d), "bias": s(d)},
             "layer_norm1": {"scale": s(d)}}
    return {"embedding_layer": {"token_emb": {"embedding": s(vocab, d)},
                                "pos_emb": {"embedding": s(128, d)}},
            "transformer_blocks": {str(i): block for i in range(layers)},
            "output_layer": {"kernel": s(d, vocab), "bias": s(vocab)}}


def test_output_head_found_by_the_vocabulary_size():
    params = _tutorial_tree()
    got = labelled(params)
    assert got["output_layer/kernel"] == "adamw"
    assert got["transformer_blocks/0/linear1/kernel"] == "muon"
    tx = muon_optax.muon_adamw({"muon": dict(kind="muon", lr=0.02),
                                "adamw": dict(kind="adamw", lr=1e-3)},
                               muon_optax.label_by_path())
    rows = {r["path"]: r for r in muon_optax.describe(tx, params, file=None)}
    assert "output head" in rows["output_layer/kernel"]["why"]
    assert "1000" in rows["output_layer/kernel"]["why"]
    assert rows["transformer_blocks/0/linear1/kernel"]["why"] == "two or more axes"
    assert rows["transformer_blocks/0/linear1/bias"]["why"] == "named as a bias, scale or embedding"
    # rules come first, and say so
    rows = {r["path"]: r for r in muon_optax.describe(
        muon_optax.muon_adamw({"m": dict(kind="muon", lr=0.02), "a": dict(kind="adamw", lr=1.0)},
                              muon_optax.label_by_path([("output_layer/kernel", "m")], matrix="m",
                                                       other="a")), params, file=None)}
    assert rows["output_layer/kernel"]["why"] == "rule 'output_layer/kernel'"


def test_no_head_guessed_where_mlps_are_as_wide_as_the_vocabulary():
    # every layer's MLP has the head's shape: no single head, the names decide
    got = labelled(_tutorial_tree(mlp_width=1000))
    assert got["output_layer/kernel"] == "muon"
    assert got["transformer_blocks/0/linear1/kernel"] == "muon"
