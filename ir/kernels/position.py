"""Kernels whose values depend on absolute positions: the causal mask and rotary embeddings.

Positions come from the shard's index box (``Kernel.run`` receives it), so a shard of rows
``[s0, s1)`` masks and rotates exactly as the whole tensor would. Because ``compute`` alone
cannot know the box, these kernels are not elementwise-fusable.
"""

from __future__ import annotations



from ir.kernels.base import Kernel, Signature, SignatureError
from ir.kernels.elementwise import elementwise_dims
from ir.kernels.rowwise import _row_signature
from ir.zspace import ZRange, identity_projection


class CausalMask(Kernel):
    """``y[..., s, t] = x[..., s, t]`` where ``t <= s + offset``, else ``fill`` (None: -inf).

    The forward masks attention scores with ``fill=None``; its gradient is the same kernel with
    ``fill=0`` applied to ``dy``.
    """

    name = "causal_mask"
    inputs = ("x",)
    kernel_class = "elementwise"
    params_defaults = {"offset": 0, "fill": None}

    def base_signature(self, ins, params):
        x = ins["x"]
        if len(x.shape) < 2:
            raise SignatureError(f"causal_mask needs [..., queries, keys], got shape {x.shape}")
        if not isinstance(params["offset"], int) or not (params["fill"] is None or
                                                         isinstance(params["fill"], (int, float))):
            raise SignatureError("causal_mask needs an integer offset and a numeric fill (or null for -inf)")
        n = len(x.shape)
        return Signature(elementwise_dims(n), x.shape, {"x": identity_projection(n)}, identity_projection(n), x, 1.0)

    def run(self, xp, blocks, params, box: ZRange, sig: Signature):
        x = blocks["x"]
        s = xp.arange(box.start[-2], box.end[-2])[:, None]
        t = xp.arange(box.start[-1], box.end[-1])[None, :]
        keep = t <= s + params["offset"]
        fill = -xp.inf if params["fill"] is None else params["fill"]
        return xp.where(keep, x, xp.asarray(fill, dtype=x.dtype))


class Rope(Kernel):
    """Rotary position embedding over ``x[..., s, e]`` (Su et al. 2021, "RoFormer", eq. 34), in the
    rotate-half pairing of GPT-NeoX and Llama: ``(x1, x2) -> (x1 cos θ - x2 sin θ, x2 cos θ + x1 sin θ)``
    with ``θ_i = s · base^(-2i/e)``. ``inverse`` rotates by ``-θ``: the rotation's transpose, i.e.
    the gradient.
    """

    name = "rope"
    inputs = ("x",)
    kernel_class = "rowwise"
    params_defaults = {"base": 10000.0, "inverse": False}

    def base_signature(self, ins, params):
        x = ins["x"]
        if len(x.shape) < 2 or x.shape[-1] % 2:
            raise SignatureError(f"rope needs x[..., seq, even head dim], got shape {x.shape}")
        return _row_signature(x, 3.0, {})

    def run(self, xp, blocks, params, box: ZRange, sig: Signature):
        x = blocks["x"]
        e = x.shape[-1]
        pos = xp.arange(box.start[-1], box.end[-1], dtype=xp.float64)  # the seq dim: last index dim
        freq = params["base"] ** (-xp.arange(0, e // 2, dtype=xp.float64) * 2.0 / e)
        ang = pos[:, None] * freq[None, :]
        cos, sin = xp.cos(ang).astype(x.dtype), xp.sin(ang).astype(x.dtype)
        if params["inverse"]:
            sin = -sin
        x1, x2 = x[..., : e // 2], x[..., e // 2 :]
        return xp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


KERNELS = (CausalMask, Rope)


