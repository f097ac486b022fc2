"""Which parameter goes to which group. A label tree has the params' structure with a group
name at every leaf (as in ``optax.partition``); :func:`label_by_path` builds one from
regular expressions on the ``/``-joined path, then the leaf's name, then its rank."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

import jax

from muon_optax.params.dimension_numbers import MuonDimensionNumbers
from muon_optax.params.variables import unbox, unboxed_structure


def path_str(path: Sequence[Any]) -> str:
    """``/``-joined readable form of a pytree key path: ``blocks/0/attn/kernel``. An
    ``nnx.Variable``'s trailing ``.value`` is dropped: ``init`` and ``update`` see one path."""
    path = list(path)
    if path and isinstance(path[-1], jax.tree_util.GetAttrKey) and path[-1].name == "value":
        path = path[:-1]
    return "/".join(str(next((getattr(k, a) for a in ("key", "idx", "name") if hasattr(k, a)),
                             k)) for k in path)


# Flax's names of leaves that are never matrices, whatever their rank: a scanned layer
# stack makes every bias and norm scale ``(L, d)``, which rank alone would send to Muon.
OTHER_NAMES = re.compile(r"(^|_)(bias|scale|embedding|embeddings|embed)$", re.IGNORECASE)

# Path components of the embeddings and output heads, which nanochat gives to AdamW
# (``wte``, ``value_embeds``, ``lm_head``, ...): an ``lm_head``'s 2-D kernel is no matrix.
OTHER_MODULES = re.compile(r"(^|_)(embeds?|embeddings?|unembed|unembedding|wte|wpe|head)$",
                           re.IGNORECASE)

# Path components of embedding tables (whose first axis is the vocabulary).
EMBEDDINGS = re.compile(r"(^|_)(embeds?|embeddings?|emb|wte)$", re.IGNORECASE)


def _by_name(name: str) -> bool:
    """Named as a bias, a scale, an embedding or an output head: not a Muon matrix."""
    return bool(OTHER_NAMES.search(name.rsplit("/", 1)[-1])) or any(
        OTHER_MODULES.search(part) for part in name.split("/"))


def label_by_path(rules: Sequence[tuple[str, str]] = (), *, matrix: str = "muon",
                  other: str = "adamw") -> Callable[[Any], Any]:
    """Returns ``params -> labels`` for :func:`muon_optax.muon_adamw`.

    Args:
      rules: ``(regex, group)`` pairs, tried in order with ``re.search`` on each
        leaf's ``/``-joined path; the first match names the leaf's group.
      matrix: group of an unmatched leaf with two or more axes (a ``kernel``, a
        ``weight``), unless its name says otherwise (below).
      other: group of every other unmatched leaf: scalars and vectors; whatever its rank, a
        leaf named ``bias``, ``scale``, ``embedding``, ``embed`` (or ending in ``_bias``, ...),
        or under a path component named ``embed(s)``, ``embedding(s)``, ``unembed(ding)``,
        ``wte``, ``wpe`` or ``head``, alone or after ``_`` (``lm_head/kernel``); and an output
        head no name gives away: the only 2-D leaf of an embedding table's shape (a 2-D leaf
        under ``embed``, ``emb``, ``wte``, ... with more rows than columns).

    Example, nanochat's split for a Flax GPT::

        labels = label_by_path([("wte", "embed"), ("lm_head", "head"),
                                ("lambdas", "scalars")], matrix="matrix")

    :func:`muon_optax.describe` shows why each leaf got its label.
    """
    compiled = []
    for rule in rules:
        if not (isinstance(rule, (tuple, list)) and len(rule) == 2):
            raise TypeError(f"label_by_path: each rule is a (regex, group) pair, got {rule!r}.")
        pattern, group = rule
        try:
            compiled.append((re.compile(pattern), group))
        except re.error as e:
            raise ValueError(f"label_by_path: bad regex {pattern!r}: {e}.") from e
    return PathLabels(tuple(compiled), matrix, other)


class PathLabels:
    """``params -> labels`` of :func:`label_by_path`; :meth:`reasons` says why."""

    def __init__(self, rules: tuple, matrix: str, other: str):
        self.rules, self.matrix, self.other = rules, matrix, other

    def __call__(self, params: Any) -> Any:
        return self._decide(params, 0)

    def reasons(self, params: Any) -> Any:
        """Why each leaf got its label, in the params' tree (for :func:`muon_optax.describe`)."""
        return self._decide(params, 1)

    def _decide(self, params: Any, part: int) -> Any:
        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        names = [path_str(p) for p, _ in flat]
        head = _vocabulary_head(names, [x for _, x in flat])
        return treedef.unflatten([self._one(name, x, head if head and head[0] == i else None)[part]
                                  for i, (name, (_, x)) in enumerate(zip(names, flat))])

    def _one(self, name: str, leaf: Any, head: tuple | None) -> tuple[str, str]:
        for pattern, group in self.rules:
            if pattern.search(name):
                return group, f"rule {pattern.pattern!r}"
        if OTHER_NAMES.search(name.rsplit("/", 1)[-1]):
            return self.other, "named as a bias, scale or embedding"
        if any(OTHER_MODULES.search(part) for part in name.split("/")):
            return self.other, "in an embedding or head module (by name)"
        if head is not None:
            return self.other, (f"output head: the only matrix with a side of the vocabulary "
                                f"size {head[1]} of {head[2]!r}")
        if getattr(leaf, "ndim", 0) >= 2:
            return self.matrix, "two or more axes"
        return self.other, "fewer than two axes"


def _vocabulary_head(names: Sequence[str], leaves: Sequence[Any]) -> tuple | None:
    """``(index, vocab, embedding path)`` of an output head no name gives away (the JAX AI
    stack's ``output_layer/kernel``): the only 2-D leaf not so named of an embedding
    table's shape. None if not alone (an MLP as wide as the vocabulary)."""
    tables = [(name, tuple(x.shape)) for name, x in zip(names, leaves)
              if getattr(x, "ndim", 0) == 2 and x.shape[0] > x.shape[1] and
              any(EMBEDDINGS.search(part) for part in name.split("/"))]
    for table, (vocab, features) in tables:
        found = [i for i, (name, x) in enumerate(zip(names, leaves))
                 if getattr(x, "ndim", 0) == 2 and sorted(x.shape) == sorted((vocab, features))
                 and not _by_name(name)]
        if len(found) == 1:
            return found[0], vocab, table
    return None


def flat_labels(param_labels: Any, params: Any, paths: Sequence[str],
                groups: Sequence[str]) -> list[str]:
    """The group name of every leaf of ``params``, in flattening order, checked."""
    labels = unbox(param_labels(params) if callable(param_labels) else param_labels)
    treedef = unboxed_structure(params)
    try:
        flat = treedef.flatten_up_to(labels)
    except (ValueError, TypeError) as e:
        raise ValueError(
            "param_labels must have the params' structure, with a group name at every "
            f"leaf (or be a callable params -> such a tree). Params: {treedef}. "
            f"Labels: {jax.tree.structure(labels)}.") from e
    for path, label in zip(paths, flat):
        if label not in groups:
            raise ValueError(
                f"parameter {path!r} has label {label!r}, which names no group; groups are "
                f"{', '.join(map(repr, groups))}. Add a group of that name or change the label.")
    return list(flat)


def attention_dimension_numbers(paths: Sequence[str],
                                shapes: Sequence[tuple[int, ...]]) -> dict[int, Any]:
    """Leaf index -> ``MuonDimensionNumbers`` for Flax attention kernels: each is one matrix, as
    nanochat's ``c_q``/``c_proj`` (``(..., in, heads, head_dim)`` and ``(..., heads, head_dim,
    out)``; leading axes stay batch axes). Only where a module holds a ``query`` and an ``out``
    kernel whose head axes agree: a scanned ``nnx.Linear``'s ``(L, in, out)`` keeps the default."""
    index = {path: i for i, path in enumerate(paths)}
    found: dict[int, Any] = {}
    for path, i in index.items():
        if not ("/" + path).endswith("/query/kernel"):
            continue
        prefix, q_shape = path[:-len("query/kernel")], shapes[i]
        out = index.get(prefix + "out/kernel")
        if out is None or len(q_shape) < 3 or len(shapes[out]) != len(q_shape) \
                or shapes[out][-3:-1] != q_shape[-2:]:
            continue
        found[out] = MuonDimensionNumbers(reduction_axis=(-3, -2), output_axis=-1)
        for name in ("query", "key", "value"):
            j = index.get(prefix + name + "/kernel")
            if j is not None and len(shapes[j]) == len(q_shape) \
                    and shapes[j][-2:] == q_shape[-2:]:
                found[j] = MuonDimensionNumbers(reduction_axis=-3, output_axis=(-2, -1))
    return found
