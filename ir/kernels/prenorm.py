"""``norm_matmul``: a row normalisation fused into the contraction that reads it.

``norm_matmul`` computes ``inner(norm(x, *norm_params), *inner_inputs)`` where ``norm`` is
``layernorm`` or ``rmsnorm`` over the last dim of ``x`` and ``inner`` is an einsum, matmul, bmm or
linear that contracts that dim (reads it whole). Every shard of the inner op already reads whole
rows of its input, so it can normalise them itself: the normalised tensor never reaches memory
(one write and one read of ``[rows, d]`` saved, and one launch). The cost: each shard repeats the
normalisation of its rows (``norm`` FLOPs per row, a few per element; the contraction does
``2·d`` per output element).

``params``: ``norm`` and ``inner``, each ``{"op", "kernel", "params"}`` (the replaced ops, so
``ir.rewrites.substitute_norm.unfuse_norm`` restores them), ``norm["output"]`` (the normalised
tensor's name) and ``inner["chain"]`` (the inner port that read it). Ports: ``x``, ``n.<port>``
for the norm's other inputs (gamma, beta), ``m.<port>`` for the inner op's other inputs. Index
space, projections of ``m.*`` and the output: the inner op's; ``x`` is read through the inner
op's chain projection.
"""

from __future__ import annotations

from typing import Any, Mapping

from ir.kernels.base import Kernel, Signature, SignatureError, TensorSpec
from ir.zspace import Projection, ZRange

NORMS = ("layernorm", "rmsnorm")
INNERS = ("einsum", "matmul", "bmm", "linear")


class NormMatmul(Kernel):
    name = "norm_matmul"
    inputs = ()
    # a GEMM with its operand's norm in the prologue; its own subclass because NumPy runs the norm
    # as a pass of its own (costmodel.hardware: without a "matmul.norm" entry it is "matmul")
    kernel_class = "matmul.norm"
    params_defaults = {"norm": None, "inner": None}

    def _parts(self, params: Mapping[str, Any]) -> tuple[dict, dict]:
        norm, inner = params.get("norm"), params.get("inner")
        if not isinstance(norm, dict) or not isinstance(inner, dict):
            raise SignatureError("norm_matmul needs params.norm and params.inner (the fused ops)")
        if norm.get("kernel") not in NORMS or inner.get("kernel") not in INNERS:
            raise SignatureError(f"norm_matmul fuses one of {list(NORMS)} into one of {list(INNERS)}, got "
                                 f"{norm.get('kernel')!r} and {inner.get('kernel')!r}")
        return norm, inner

    def stage_signatures(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]):
        from ir.kernels import get_kernel

        norm, inner = self._parts(params)
        nk, ik = get_kernel(norm["kernel"]), get_kernel(inner["kernel"])
        if "x" not in ins:
            raise SignatureError("norm_matmul lacks input 'x'")
        n_ins = {"x": ins["x"], **{p: ins.get(f"n.{p}") for p in nk.inputs if p != "x"}}
        i_ins = {p: ins.get(f"m.{p}") for p in ik.inputs if p != inner.get("chain")}
        missing = [f"n.{p}" for p, s in n_ins.items() if s is None] + [f"m.{p}" for p, s in i_ins.items() if s is None]
        if missing or inner.get("chain") not in ik.inputs:
            raise SignatureError(f"norm_matmul lacks inputs {missing or [inner.get('chain')]}")
        nsig = nk.signature(n_ins, norm.get("params", {}))
        isig = ik.signature({**i_ins, inner["chain"]: nsig.out_spec}, inner.get("params", {}))
        proj = isig.inputs[inner["chain"]]
        last = len(ins["x"].shape) - 1
        if any(proj.A[last]) or proj.s[last] != ins["x"].shape[-1]:
            raise SignatureError(f"{inner['kernel']} does not read the normalised dim whole (it must contract it)")
        return (nk, nsig), (ik, isig)

    def signature(self, ins, params):
        (nk, nsig), (ik, isig) = self.stage_signatures(ins, params)
        inner = params["inner"]
        inputs: dict[str, Projection] = {"x": isig.inputs[inner["chain"]]}
        for p in nk.inputs:
            if p != "x":  # gamma, beta: whole vectors, read by every index point
                pn = nsig.inputs[p]
                if any(any(row) for row in pn.A):
                    raise SignatureError(f"{nk.name} input {p!r} is not a whole vector")
                inputs[f"n.{p}"] = Projection(tuple((0,) * len(isig.dims) for _ in pn.A), pn.b, pn.s)
        for p in ik.inputs:
            if p != inner["chain"]:
                inputs[f"m.{p}"] = isig.inputs[p]
        # The norm's FLOPs per row, shared by the output cells of that row (each column shard repeats them).
        rows_out = max(1, isig.index.size // max(1, nsig.index.size))
        flops = isig.flops_per_point + nsig.flops_per_point / rows_out
        return Signature(isig.dims, isig.extents, inputs, isig.output, isig.out_spec, flops, (), dict(ins))

    def run(self, xp: Any, blocks: Mapping[str, Any], params: Mapping[str, Any], box: ZRange, sig: Signature) -> Any:
        from ir.kernels import get_kernel

        norm, inner = params["norm"], params["inner"]
        nk, ik = get_kernel(norm["kernel"]), get_kernel(inner["kernel"])
        x = blocks["x"]
        own = {p: (x if p == "x" else blocks[f"n.{p}"]) for p in nk.inputs}
        h = nk.compute(xp, own, {**nk.params_defaults, **norm.get("params", {})})
        m = {p: (h if p == inner["chain"] else blocks[f"m.{p}"]) for p in ik.inputs}
        return ik.compute(xp, m, {**ik.params_defaults, **inner.get("params", {})})

    def compute(self, xp, blocks, params):
        return self.run(xp, blocks, params, ZRange((), ()), None)  # neither stage needs the box


KERNELS = (NormMatmul,)
