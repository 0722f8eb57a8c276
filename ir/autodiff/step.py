"""``training_step``: forward + loss + backward + optimizer update as one graph.

Given a forward program (unsharded or not: it is taken back to its logical form first), the step

0. takes the program back to its logical form (``unshard(g, keep_substitutions=True)``: no splits,
   fusions or recomputed copies, whole shards; substitutions such as fused attention stay,
   differentiated by their own rules). Norms fused into their contractions (``norm_matmul``)
   are unfused: the backward reads the normalised activations, which a fused norm never writes
   (TransformerEngine's ``LayerNormLinear`` returns them as a second output for that reason). The
   search may fuse them again in the step, where ``fuse_norm`` keeps the norm for its backward;
1. optionally keeps fp32 *master weights*: every low-precision parameter ``P`` becomes an fp32
   parameter, and an op ``P.cast`` writes the ``P.lowp`` copy that the forward reads (mixed
   precision as in Micikevicius et al. 2018, "Mixed Precision Training");
2. appends the loss (``loss``: ``mse`` against an input ``target`` shaped like the output, or
   ``cross_entropy`` over the last dim against int32 ``labels``) and its gradient (``loss.grad``);
3. appends the backward (``ir.autodiff.reverse``);
4. appends the optimizer's update ops (``ir.autodiff.optimizers``), which write ``P.next`` for
   every parameter ``P`` and ``S.next`` for every optimizer state ``S`` (``P.m``, ``P.v`` for
   AdamW; ``P.momentum`` for SGD with momentum).

The step's outputs are ``loss`` and every ``.next`` tensor; parameters and states are
loop-carried (``Graph.carried``).
"""

from __future__ import annotations

from typing import Any, Mapping

from ir.autodiff.errors import AutodiffError, op_name
from ir.autodiff.optimizers import OPTIMIZERS, append_updates
from ir.autodiff.reverse import backward
from ir.builder import GraphBuilder
from ir.graph import Graph, Op, Shards, Tensor
from ir.kernels import INDEX_DTYPE
from ir.rewrites import unshard
from ir.rewrites.substitute_norm import fused_norms, unfuse_norm

LOSSES = ("mse", "cross_entropy")
LOW_PRECISION = ("bfloat16", "float16")


def _master_weights(g: Graph) -> Graph:
    """fp32 parameters with ``P.cast`` ops writing the low-precision copies the forward reads."""
    low = [n for n, t in g.tensors.items() if t.role == "parameter" and t.dtype in LOW_PRECISION]
    if not low:
        return g
    tensors = dict(g.tensors)
    ops: dict[str, Op] = {}
    for p in low:
        t = g.tensors[p]
        tensors[p] = Tensor(p, t.shape, "float32", "parameter")
        tensors[f"{p}.lowp"] = Tensor(f"{p}.lowp", t.shape, t.dtype, "intermediate")
        ops[op_name(p, ".cast")] = Op(op_name(p, ".cast"), "cast", (("x", p),), f"{p}.lowp", {"dtype": t.dtype},
                                      Shards.whole(t.shape))
    rename = {p: f"{p}.lowp" for p in low}
    for n, o in g.ops.items():
        ops[n] = o.replace(inputs=tuple((port, rename.get(x, x)) for port, x in o.inputs))
    return Graph(tensors, ops)


def _output(g: Graph, output: str | None) -> str:
    outs = [n for n, t in g.tensors.items() if t.role == "output"]
    if output is not None:
        if output not in g.tensors or output not in g.producers:
            raise AutodiffError(f"output {output!r} is not a produced tensor of the program; outputs are {outs}")
    elif len(outs) != 1:
        raise AutodiffError(f"the program has {len(outs)} outputs {outs}; name the one the loss reads with output=")
    else:
        output = outs[0]
    if g.tensors[output].dtype == INDEX_DTYPE:  # argmax indices: no loss reads them, no gradient passes them
        src = g.producers[output]
        raise AutodiffError(f"op {src!r}: kernel {g.ops[src].kernel!r} has no gradient; output {output!r} holds "
                            f"integer indices, which no loss reads (train on a float output: output=)")
    return output


def training_step(g: Graph, loss: str = "mse", optimizer: str = "sgd", output: str | None = None,
                  master_weights: bool | None = None, optimizer_params: Mapping[str, Any] | None = None) -> Graph:
    """One training step of forward program ``g`` as a single validated graph.

    ``loss``: ``mse`` or ``cross_entropy``; ``optimizer``: ``sgd`` (``momentum`` > 0 adds a
    momentum state) or ``adamw``; ``optimizer_params`` go to the update ops (``lr``,
    ``weight_decay``, ``momentum``, ``beta1``, ``beta2``, ``eps``, ``step``). ``master_weights``
    (default: on when any parameter is bf16/fp16) keeps fp32 parameters and optimizer state.
    """
    if loss not in LOSSES:
        raise AutodiffError(f"loss {loss!r} is not one of {list(LOSSES)}")
    if optimizer not in OPTIMIZERS:
        raise AutodiffError(f"optimizer {optimizer!r} is not one of {sorted(OPTIMIZERS)}")
    if g.carried:
        raise AutodiffError("the program is already a training step (it writes next values of its state)")
    g = unshard(g, keep_substitutions=True)
    for n in fused_norms(g):  # the backward needs the normalised activations (module doc)
        g = unfuse_norm(g, n)
    y = _output(g, output)
    if master_weights is None:
        master_weights = any(t.role == "parameter" and t.dtype in LOW_PRECISION for t in g.tensors.values())
    if master_weights:
        g = _master_weights(g)
    # integer parameters are constants (an imported model's constant ids): nothing to train
    params = [n for n, t in g.tensors.items() if t.role == "parameter" and t.dtype != INDEX_DTYPE]
    if not params:
        raise AutodiffError("the program has no parameters to train")
    b = GraphBuilder.from_graph(g)
    yt = b.tensor(y)
    if loss == "mse":
        if "target" in g.tensors:
            raise AutodiffError("the program already has a tensor named 'target' (the mse loss's input)")
        target = b.input("target", yt.shape, yt.dtype)
        b.op("mse_loss", "loss", {"y": y, "target": target}, out="loss")
        count = 1
        for e in yt.shape:
            count *= e
        seed = b.op("mse_loss_grad", "loss.grad", {"y": y, "target": target}, count=count)
    else:
        if len(yt.shape) < 2:
            raise AutodiffError(f"cross_entropy needs logits [..., vocab]; output {y!r} has shape {list(yt.shape)}")
        if "labels" in g.tensors:
            raise AutodiffError("the program already has a tensor named 'labels' (the cross-entropy input)")
        labels = b.input("labels", yt.shape[:-1], INDEX_DTYPE)
        b.op("cross_entropy", "loss", {"logits": y, "labels": labels}, out="loss")
        count = 1
        for e in yt.shape[:-1]:
            count *= e
        seed = b.op("cross_entropy_grad", "loss.grad", {"logits": y, "labels": labels}, count=count)
    grads = backward(b, g, {y: seed}, params)
    nexts = append_updates(b, grads, optimizer, dict(optimizer_params or {}))
    return b.build(outputs=["loss", *nexts])  # validated by build
