"""Group normalisation over ``x[N, C, *spatial]`` (Wu & He 2018): ``group_norm`` and its backward.

``y = (x - mean) / sqrt(var + eps) · scale[c] + bias[c]``, the mean and (biased) variance taken
per sample ``n`` and group ``g`` over the group's ``C/G`` channels and every spatial cell (ONNX
``GroupNormalization``, opset 18 and 21; ``InstanceNormalization`` is the case ``G = C``).

Index dims ``(n, g)``: each index point reads and writes one whole group slab
``x[n, g·C/G : (g+1)·C/G, *spatial]`` (the statistics need all of it, so the slab hides in the
projection shape, as a row hides in ``layernorm``'s). The affine vectors are per channel
(``affine="channel"``: shape ``[C]``, read at ``[g·C/G, (g+1)·C/G)``; ONNX opset 21 and
``InstanceNormalization``) or per group (``affine="group"``: shape ``[G]``, read at ``g``; ONNX
opset 18, where each group's one value scales all its channels).

Backward (the rule is in ``ir.autodiff.rules``): ``group_norm_grad`` (``dy``, ``x``, ``scale``)
gives ``dx = r·(h - mean(h) - x̂·mean(h·x̂))`` with ``h = dy·scale[c]``, ``r = 1/sqrt(var + eps)``
and the means over the slab (layernorm's formula over the slab); ``group_normalize`` (``x``)
gives ``x̂``, from which the scale gradient is ``Σ dy·x̂`` summed to the affine vector's shape.
"""

from __future__ import annotations

from typing import Any, Mapping

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec, unit_row, zero_row
from ir.zspace import Projection

AFFINE = ("channel", "group")


def _check(name: str, x: tuple[int, ...], params: Mapping[str, Any]) -> int:
    """The channels per group, after checking ``x`` and ``groups``."""
    g = params["groups"]
    if len(x) < 2:
        raise SignatureError(f"{name} needs x[N, C, ...] of rank >= 2, got {list(x)}")
    if not isinstance(g, int) or isinstance(g, bool) or g < 1 or x[1] % g:
        raise SignatureError(f"{name} groups must be a positive divisor of the {x[1]} channels, got {g!r}")
    if not isinstance(params["eps"], (int, float)) or isinstance(params["eps"], bool) or params["eps"] < 0:
        raise SignatureError(f"{name} eps must be a number >= 0, got {params['eps']!r}")
    return x[1] // g


def slab(x: tuple[int, ...], per: int) -> Projection:
    """Index point ``(n, g)`` -> ``x[n, g·per : (g+1)·per, *spatial]``."""
    rows = (unit_row(2, 0), (0, per)) + (zero_row(2),) * (len(x) - 2)
    return Projection(rows, (0,) * len(x), (1, per) + tuple(x[2:]))


def affine_projection(kind: str, per: int) -> Projection:
    """The affine vector of group ``g``: its ``per`` channels, or its one value."""
    return Projection(((0, per),), (0,), (per,)) if kind == "channel" else Projection(((0, 1),), (0,), (1,))


def _signature(name: str, ins: Mapping[str, TensorSpec], params: Mapping[str, Any], x_port: str,
               vectors: tuple[str, ...], flops: float, extra: tuple[str, ...] = ()) -> Signature:
    x = ins[x_port].shape
    per = _check(name, x, params)
    groups = params["groups"]
    inputs = {x_port: slab(x, per), **{p: slab(x, per) for p in extra}}
    for p in extra:
        if ins[p].shape != x:
            raise SignatureError(f"{name} needs {p} shaped like {x_port} {list(x)}, got {list(ins[p].shape)}")
    if vectors:
        kind = params["affine"]
        if kind not in AFFINE:
            raise SignatureError(f"{name} affine must be one of {list(AFFINE)}, got {kind!r}")
        want = (x[1],) if kind == "channel" else (groups,)
        for p in vectors:
            if ins[p].shape != want:
                raise SignatureError(f"{name} {p} must have shape {list(want)} (affine={kind!r}), "
                                     f"got {list(ins[p].shape)}")
            inputs[p] = affine_projection(kind, per)
    size = per
    for d in x[2:]:
        size *= d
    return Signature(("n", "g"), (x[0], groups), inputs, slab(x, per), TensorSpec(x, ins[x_port].dtype), flops * size)


def _stats(xp: Any, x: Any, groups: int, eps: float) -> tuple[Any, Any]:
    """``(x̂, r)`` of a block ``x[n, c, ...]`` holding ``groups`` whole groups; ``r = 1/std`` per
    (sample, group), shaped to broadcast against the ``[n, groups, C/groups·spatial]`` view."""
    v = xp.reshape(x, (x.shape[0], groups, -1))
    mu = xp.mean(v, axis=-1, keepdims=True)
    r = 1.0 / xp.sqrt(xp.mean((v - mu) ** 2, axis=-1, keepdims=True) + eps)
    return (v - mu) * r, r


def _per_channel(xp: Any, vec: Any, kind: str, x: Any, groups: int) -> Any:
    """The affine vector block broadcast to ``x``'s block: ``[1, c, 1, ...]``."""
    if kind == "group":
        vec = xp.repeat(vec, x.shape[1] // groups)
    return xp.reshape(vec, (1, -1) + (1,) * (x.ndim - 2))


class _GroupKernel(Kernel):
    """Shared block logic: a block holds whole groups, as many as the shard's ``g`` extent."""

    kernel_class = "rowwise"
    params_defaults = {"groups": 1, "eps": 1e-5, "affine": "channel"}

    def compute(self, xp, blocks, params):
        # the whole tensor (or a shard's blocks, via ``run``, which knows how many groups they hold)
        return self.block(xp, blocks, params, params["groups"])

    def run(self, xp, blocks, params, box, sig):
        return self.block(xp, blocks, params, int(box.end[1] - box.start[1]))

    def block(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any], groups: int) -> Any:
        raise NotImplementedError


class GroupNorm(_GroupKernel):
    name = "group_norm"
    inputs = ("x", "scale", "bias")

    def base_signature(self, ins, params):
        return _signature(self.name, ins, params, "x", ("scale", "bias"), 8.0)

    def block(self, xp, blocks, params, groups):
        x, kind = blocks["x"], params["affine"]
        xh = xp.reshape(_stats(xp, x, groups, params["eps"])[0], x.shape)
        return xh * _per_channel(xp, blocks["scale"], kind, x, groups) + _per_channel(xp, blocks["bias"], kind, x,
                                                                                       groups)


class GroupNormalize(_GroupKernel):
    """``x̂`` of ``group_norm`` (no affine): what the scale gradient reads."""

    name = "group_normalize"
    inputs = ("x",)
    params_defaults = {"groups": 1, "eps": 1e-5}

    def base_signature(self, ins, params):
        return _signature(self.name, ins, params, "x", (), 5.0)

    def block(self, xp, blocks, params, groups):
        x = blocks["x"]
        return xp.reshape(_stats(xp, x, groups, params["eps"])[0], x.shape)


class GroupNormGrad(_GroupKernel):
    """``dx`` of ``group_norm`` from ``dy``, the forward input ``x`` and ``scale``."""

    name = "group_norm_grad"
    inputs = ("dy", "x", "scale")

    def base_signature(self, ins, params):
        return _signature(self.name, ins, params, "dy", ("scale",), 10.0, extra=("x",))

    def block(self, xp, blocks, params, groups):
        dy, x = blocks["dy"], blocks["x"]
        xh, r = _stats(xp, x, groups, params["eps"])
        h = xp.reshape(dy * _per_channel(xp, blocks["scale"], params["affine"], x, groups), xh.shape)
        dx = r * (h - xp.mean(h, axis=-1, keepdims=True) - xh * xp.mean(h * xh, axis=-1, keepdims=True))
        return xp.reshape(dx, x.shape)


KERNELS = (GroupNorm, GroupNormalize, GroupNormGrad)
