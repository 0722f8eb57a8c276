"""Fused operations: a producer followed by a chain of elementwise consumers.

The producer may be a ``norm_matmul`` (a norm in the GEMM's prologue, the elementwise chain in
its epilogue: TransformerEngine's ``LayerNormMLP`` runs layernorm, fc1 and GELU so); its ports
come from its params, so stage 0's ports are whatever ``0.<port>`` inputs the op has.

``params["stages"]`` lists the stages in order; each stage records its original operation name,
kernel, params, the port (``chain``) that reads the previous stage's output and the name of that
intermediate tensor (``via``), so ``unfuse`` restores the original operations exactly. The fused
op's input ports are ``"<stage>.<port>"`` for every non-chain input.

The index space is stage 0's. Stage i's index box for a fused index point is the previous
stage's output box, so its projections are composed: ``P_in ∘ M_i`` with
``M_i = P_out(i-1) ∘ M_(i-1)`` and ``M_0`` the identity. Intermediates never leave the kernel,
so the fused op's bytes count only its external inputs and final output.
"""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ir.kernels.base import ELEMENTWISE, ITEMSIZE, Kernel, Signature, SignatureError, TensorSpec
from ir.zspace import Projection, ZRange, identity_projection


#: stage signatures by (input specs, stages) for :meth:`Fused.run`; bounded, cleared when full
_RUN_STAGES: dict[tuple, list] = {}
_RUN_STAGES_MAX = 4096


def stage_port(i: int, port: str) -> str:
    return f"{i}.{port}"


def _stage_ports(k: Kernel, i: int, ins: Mapping[str, Any]) -> tuple[str, ...]:
    """Stage ``i``'s own ports: its kernel's, or for a stage 0 whose kernel takes its ports from
    its params (``norm_matmul``), the fused op's ``0.<port>`` inputs."""
    if k.inputs or i:  # an optional port (attention's bias) is a stage's own when the fused op has it
        return tuple(p for p in k.inputs if p not in k.optional_inputs or stage_port(i, p) in ins)
    return tuple(p[2:] for p in ins if p.startswith("0."))


class Fused(Kernel):
    name = "fused"
    inputs = ()
    kernel_class = "fused"

    def _stages(self, params: Mapping[str, Any]) -> list[dict]:
        stages = params.get("stages")
        if not isinstance(stages, list) or len(stages) < 2:
            raise SignatureError("fused op needs params.stages: a list of at least two stages")
        return stages

    def stage_signatures(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]):
        """Per stage: (kernel, own signature, map M_i from fused index to stage index boxes)."""
        from ir.kernels import get_kernel

        out = []
        prev_spec: TensorSpec | None = None
        M: Projection | None = None
        for i, st in enumerate(self._stages(params)):
            k = get_kernel(st["kernel"])
            if st.get("params", {}).get("split"):  # run() calls compute(), which knows no reduction blocks
                raise SignatureError(f"fused stage {i} ({st['kernel']}) has a split reduction; split ops are not fused")
            own = {}
            for port in _stage_ports(k, i, ins):
                if i > 0 and port == st["chain"]:
                    own[port] = prev_spec
                elif stage_port(i, port) in ins:
                    own[port] = ins[stage_port(i, port)]
                else:
                    raise SignatureError(f"fused op lacks input {stage_port(i, port)!r}")
            sig = k.signature(own, st.get("params", {}))
            if i == 0:
                M = identity_projection(len(sig.dims))
            else:
                if ELEMENTWISE not in k.properties:
                    raise SignatureError(f"fused stage {i} ({st['kernel']}) is not elementwise")
                if sig.out_spec.shape != prev_spec.shape:
                    raise SignatureError(f"fused stage {i} broadcasts the chained tensor {prev_spec.shape}")
                M = out[-1][1].output.compose(M)
            out.append((k, sig, M))
            prev_spec = sig.out_spec
        return out

    def signature(self, ins, params):
        stages = self.stage_signatures(ins, params)
        k0, sig0, _ = stages[0]
        inputs: dict[str, Projection] = {}
        flops = 0.0
        for i, (k, sig, M) in enumerate(stages):
            chain = self._stages(params)[i].get("chain") if i else None
            for port, proj in sig.inputs.items():
                if port != chain:
                    inputs[stage_port(i, port)] = proj.compose(M)
            flops += sig.flops_per_point * float(np.prod(M.s))
        k_last, sig_last, M_last = stages[-1]
        return Signature(sig0.dims, sig0.extents, inputs, sig_last.output.compose(M_last), sig_last.out_spec,
                         flops, (), dict(ins))

    def epilogue_work(self, sig: Signature, params: Mapping[str, Any]) -> list[tuple[str, float, float]]:
        """Per stage after the first: ``(kernel_class, FLOPs, bytes)`` per cell of the fused op's
        output, the work of that stage run on its own (as an unfused executor runs it): it reads
        the chained intermediate and its other full-size inputs and writes its output (an input
        smaller than the output, e.g. a bias row, is broadcast and counted as free). Elementwise
        stages keep the output's shape, so their index points are the output's cells."""
        stages = self._stages(params)
        out = []
        for i, (k, ssig, _) in enumerate(self.stage_signatures(sig.in_specs, params)):
            if i == 0:
                continue
            cells = float(np.prod(ssig.out_spec.shape))
            full = sum(1 for port, spec in ssig.in_specs.items()
                       if port != stages[i]["chain"] and float(np.prod(spec.shape)) >= cells)
            item = float(ITEMSIZE[ssig.out_spec.dtype])
            out.append((k.kernel_class, float(ssig.flops_per_point), item * (2.0 + full)))
        return out

    def _run_stages(self, ins: Mapping[str, TensorSpec], params: Mapping[str, Any]):
        """:meth:`stage_signatures`, remembered: an executor runs every shard of a fused op, and
        rebuilding its stages' signatures each time cost ~0.3-0.5 ms a shard (an einsum+add shard of
        ~1.1 ms ran ~1.5x slower fused than as two ops)."""
        key = (tuple(sorted(ins.items())), repr(params.get("stages")))
        hit = _RUN_STAGES.get(key)
        if hit is None:
            if len(_RUN_STAGES) >= _RUN_STAGES_MAX:
                _RUN_STAGES.clear()
            hit = _RUN_STAGES[key] = self.stage_signatures(ins, params)
        return hit

    def run(self, xp, blocks, params, box: ZRange, sig: Signature):
        stages = self._stages(params)
        specs = sig.in_specs
        y = None
        for i, (k, ssig, M) in enumerate(self._run_stages(specs, params)):
            own = {port: blocks[stage_port(i, port)] for port in _stage_ports(k, i, specs)
                   if not (i and port == stages[i]["chain"])}
            if i:
                own[stages[i]["chain"]] = y
            # Stage 0's index box is the fused op's box: kernels that need it (causal masks, attention) get it.
            y = k.run(xp, own, ssig_params(k, stages[i]), box, ssig) if i == 0 else k.compute(
                xp, own, ssig_params(k, stages[i]))
        return y


def ssig_params(k: Kernel, stage: Mapping[str, Any]) -> dict:
    return {**k.params_defaults, **stage.get("params", {})}


KERNELS = (Fused,)
