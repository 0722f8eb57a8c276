"""ONNX ``BatchNormalization`` -> ``batchnorm2d`` (registered in ``HANDLERS``), in both modes.

**Inference** (``training_mode=0``, the default): ``batchnorm2d(x, scale, B, input_mean,
input_var)`` on the running statistics.

**Training** (``training_mode=1``, opsets 14 and 15; ``torch.nn.BatchNorm*d`` in train mode): the
statistics of the batch, per channel over ``N`` and the spatial dims (ONNX operator spec,
``BatchNormalization``: ``current_mean = ReduceMean(X, axis=all_except_channel_index)``,
``current_var = ReduceVar(X, ...)``, the biased variance, as ``torch.nn.BatchNorm2d`` normalises
with), composed of existing kernels::

    m_k  = reduce_mean(..reduce_mean(x, -1).., -1)     spatial dims, one op each: [N, C]
    mean = reduce_mean(m_k, 0)                         the batch: [C]
    xc   = sub(x, reshape(mean, [C, 1, ...]))
    var  = (the same reductions of) pow(xc, 2)         two passes: E[(x-mean)^2], no cancellation
    y    = batchnorm2d(x, scale, B, mean, var)

The batch is the last, separate reduction over a ``[N, C]`` tensor, a splittable ``sum``: a
data-parallel plan splits it (``split_reduction`` + ``accumulate``), so each device sends ``C``
partial sums per statistic, SyncBatchNorm's cross-device reduction, and the cost model prices it
like any other. Gradients flow through the statistics by the kernels' own rules (``batchnorm2d``'s
gradient with respect to its ``mean`` and ``var``, then the reductions'), which is the gradient
of torch's train-mode batch norm; the backward's per-channel sums over the batch are again
splittable reductions (SyncBatchNorm's backward all-reduce).

The optional outputs ``running_mean`` and ``running_var`` are computed as ONNX specifies:
``input_mean · momentum + current_mean · (1 - momentum)`` and likewise with the (biased)
``current_var``. (``torch.nn.BatchNorm*d`` updates its buffer with the unbiased variance; the
exporter does not make these outputs graph outputs, so imported torch models do not compute them.)

Refused: training before opset 14 (``BatchNormalization``-9's four extra outputs; re-export at
opset 14 or later), running-statistics outputs in inference mode (the spec defines them only in
training mode), and ``x`` of rank below 2.
"""

from __future__ import annotations

from typing import Any

from ir.importers.onnx_ops import Context, Unsupported, attr, handles


def channel_mean(ctx: Context, x: str, label: str) -> str:
    """The ``[C]`` mean of ``x[N, C, *spatial]`` over all dims but the channel: the spatial dims
    first (local to a batch shard), then the batch, a reduction of a ``[N, C]`` tensor that a
    data-parallel plan splits into per-device partial sums of ``C`` values."""
    rank = len(ctx.prog.spec(x).shape)
    t = x
    for k in range(rank - 2):
        t = ctx.emit("reduce_mean", {"x": t}, {"dim": -1}, name=f"{label}.spatial{k}" if rank > 3 else
                     f"{label}.spatial")
    return ctx.emit("reduce_mean", {"x": t}, {"dim": 0}, name=f"{label}.batch")


def _running(ctx: Context, old: str, current: str, momentum: float, out: str, label: str) -> None:
    """``old · momentum + current · (1 - momentum)`` (ONNX's running-statistics update)."""
    a = ctx.emit("scale", {"x": ctx.use(old)}, {"alpha": momentum}, name=f"{label}.keep")
    b = ctx.emit("scale", {"x": current}, {"alpha": 1.0 - momentum}, name=f"{label}.new")
    ctx.emit("add", {"a": a, "b": b}, out=out, name=label)


@handles("BatchNormalization")
def _batchnorm(ctx: Context, node: Any, label: str) -> None:
    eps = float(attr(node, "epsilon", 1e-5))
    extra = [o for o in node.output[1:] if o]
    ports = ("x", "scale", "bias", "mean", "var")
    if ctx.opset < 14:
        if extra:
            raise Unsupported(f"training-mode BatchNormalization at opset {ctx.opset} (the running and saved "
                              f"statistics outputs of BatchNormalization-9); re-export at opset 14 or later, "
                              f"where training_mode=1 says it")
        training = False
    else:
        training = bool(attr(node, "training_mode", 0))
    if not training:
        if extra:
            raise Unsupported("running_mean / running_var outputs with training_mode=0 (ONNX defines them "
                              "only in training mode)")
        ctx.emit("batchnorm2d", {p: ctx.use(n) for p, n in zip(ports, node.input)}, {"eps": eps},
                 out=node.output[0], name=label)
        return
    x = ctx.use(node.input[0])
    shape = ctx.prog.spec(x).shape
    if len(shape) < 2:
        raise Unsupported(f"training-mode batch norm of an input of rank {len(shape)}; it needs x[N, C, ...]")
    mean = channel_mean(ctx, x, f"{label}.mean")
    per_channel = [shape[1]] + [1] * (len(shape) - 2)  # right-aligned against x: broadcasts per channel
    mean_b = mean if len(shape) == 2 else \
        ctx.emit("reshape", {"x": mean}, {"shape": per_channel, "from": [shape[1]]}, name=f"{label}.mean_b")
    xc = ctx.emit("sub", {"a": x, "b": mean_b}, name=f"{label}.centre")
    sq = ctx.emit("pow", {"x": xc}, {"exponent": 2.0}, name=f"{label}.square")
    var = channel_mean(ctx, sq, f"{label}.var")
    ctx.emit("batchnorm2d", {"x": x, "scale": ctx.use(node.input[1]), "bias": ctx.use(node.input[2]),
                             "mean": mean, "var": var}, {"eps": eps}, out=node.output[0], name=label)
    momentum = float(attr(node, "momentum", 0.9))
    for k, current, what in ((1, mean, "running_mean"), (2, var, "running_var")):
        if len(node.output) > k and node.output[k]:
            _running(ctx, node.input[k + 2], current, momentum, node.output[k], f"{label}.{what}")
