"""Embedding lookup and its gradient (a scatter-add), with integer token ids.

``embedding(table[V, D], ids[*n]) -> y[*n, D]``: index dims ``(*n, d)``. Which table rows a
shard reads depends on the ids' values, so the projection reads every row of its ``d`` columns
(an honest over-approximation: a vocabulary-sharded table needs every shard's rows).

``embedding_grad(ids[*n], dy[*n, D]) -> dtable[V, D]``: index dims ``(v, d)``; every shard reads
all ids and the ``d`` columns of ``dy``, and scatter-adds the rows whose id falls in its ``v``
range. The sum over tokens is a splittable reduction over the batch (dim 0), so data-parallel
gradient synchronisation of an embedding is ``split_reduction`` like any weight gradient.

``padding_idx`` (both kernels; None by default) is ``torch.nn.Embedding``'s: the lookup is
unchanged, but the row's gradient is zero, so padding tokens never update it (BERT's ``[PAD]``).
"""

from __future__ import annotations

from ir.kernels.base import Kernel, Reduction, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection, ZRange, identity_projection


class Embedding(Kernel):
    name = "embedding"
    inputs = ("table", "ids")
    index_ports = ("ids",)
    kernel_class = "elementwise"
    params_defaults = {"padding_idx": None}

    def base_signature(self, ins, params):
        table, ids = ins["table"].shape, ins["ids"].shape
        if len(table) != 2:
            raise SignatureError(f"embedding table must be [vocab, dim], got {list(table)}")
        _check_padding(self.name, params["padding_idx"], table[0])
        n = len(ids) + 1
        pt = Projection((zero_row(n), unit_row(n, n - 1)), (0, 0), (table[0], 1))
        pi = Projection(tuple(unit_row(n, k) for k in range(len(ids))), (0,) * len(ids), (1,) * len(ids))
        out = ids + (table[1],)
        return Signature(tuple(f"n{k}" for k in range(len(ids))) + ("d",), out, {"table": pt, "ids": pi},
                         identity_projection(n), TensorSpec(out, ins["table"].dtype), 0.0)

    def value_range(self, port, ins, params):
        return (0, ins["table"].shape[0]) if port == "ids" else None

    def compute(self, xp, blocks, params):
        return blocks["table"][blocks["ids"]]


class EmbeddingGrad(Kernel):
    name = "embedding_grad"
    inputs = ("ids", "dy")
    index_ports = ("ids",)
    kernel_class = "reduction"
    params_defaults = {"vocab": 0, "padding_idx": None}

    def base_signature(self, ins, params):
        ids, dy = ins["ids"].shape, ins["dy"].shape
        V = params["vocab"]
        if not isinstance(V, int) or V < 1:
            raise SignatureError(f"embedding_grad needs a positive integer vocab, got {V!r}")
        _check_padding(self.name, params["padding_idx"], V)
        if dy[:-1] != ids:
            raise SignatureError(f"embedding_grad needs dy[*ids.shape, D]; got ids{list(ids)}, dy{list(dy)}")
        r = len(ids)
        pi = Projection(tuple(zero_row(2) for _ in ids), (0,) * r, ids)
        pd = Projection(tuple(zero_row(2) for _ in ids) + (unit_row(2, 1),), (0,) * (r + 1), ids + (1,))
        red = Reduction("n", ids[0], "sum", (("ids", 0), ("dy", 0)))
        tokens = 1
        for e in ids:
            tokens *= e
        return Signature(("v", "d"), (V, dy[-1]), {"ids": pi, "dy": pd}, identity_projection(2),
                         TensorSpec((V, dy[-1]), ins["dy"].dtype), float(tokens) / V, (red,))

    def value_range(self, port, ins, params):
        return (0, params["vocab"]) if port == "ids" else None

    def run(self, xp, blocks, params, box: ZRange, sig: Signature):
        split, pad = params.get("split"), params.get("padding_idx")
        if not split:
            return _scatter_rows(xp, blocks["ids"], blocks["dy"], box.start[0], box.end[0], pad)
        chunk = sig.split_from.extent // split["parts"]
        parts = []
        for j in range(box.start[0], box.end[0]):  # reduction blocks: token chunks along dim 0
            local = j - box.start[0]
            ids = blocks["ids"][local * chunk:(local + 1) * chunk]
            dy = blocks["dy"][local * chunk:(local + 1) * chunk]
            parts.append(_scatter_rows(xp, ids, dy, box.start[1], box.end[1], pad))
        return xp.stack(parts, axis=0)


def _check_padding(kernel: str, pad, vocab: int) -> None:
    if pad is not None and (not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < vocab):
        raise SignatureError(f"{kernel} padding_idx must be a row 0..{vocab - 1} or null, got {pad!r}")


def _scatter_rows(xp, ids, dy, v0: int, v1: int, pad: int | None = None):
    """``out[v - v0] += dy[token]`` for every token whose id ``v`` lies in ``[v0, v1)`` (and is not
    ``pad``)."""
    flat = ids.reshape(-1)
    rows = dy.reshape(flat.shape[0], dy.shape[-1])
    out = xp.zeros((v1 - v0, dy.shape[-1]), dtype=dy.dtype)
    hit = (flat >= v0) & (flat < v1)
    if pad is not None:
        hit &= flat != pad
    if hasattr(xp, "add") and hasattr(xp.add, "at"):
        xp.add.at(out, flat[hit] - v0, rows[hit])
    else:  # one-hot contraction where the backend has no unbuffered scatter-add
        onehot = ((flat[:, None] == xp.arange(v0, v1)[None, :]) & hit[:, None]).astype(dy.dtype)
        out = onehot.T @ rows
    return out


KERNELS = (Embedding, EmbeddingGrad)
