"""``verify``: run a plan and its program (the unsharded original) on the same inputs and compare.

The reference is the program the plan was derived from (a plan file names it by digest; see
``ir.serialize``), or ``unshard(g)`` when none is given: that default proves only that the
sharding is consistent with the plan's own operations. Before running anything, ``verify``
checks that the plan reads and writes the program's tensors (same sources and outputs, shapes
and dtypes): a plan that drops or renames one FAILs with the difference named.

Execution is bounded (``ExecutionTooLarge``, a user error): both runs together may hold at most
``max_bytes`` of tensors and compute at most ``max_flops``, so a plan with 2**20 rows is
refused at once instead of running until killed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from executor.backend import to_numpy
from executor.run import execute, outputs, random_inputs
from ir.graph import SOURCE_ROLES, Graph
from ir.kernels import ITEMSIZE
from ir.rewrites import unshard

#: default bounds of one verify (both runs together)
MAX_BYTES = 4 << 30
MAX_FLOPS = 2e12


class ExecutionTooLarge(ValueError):
    """Running the plan and its program would take more memory or compute than allowed."""

# Relative error bounds (max |plan - ref| / max |ref|): summation order changes under reduction
# splits, so the bound scales with the storage dtype's unit roundoff (float16 eps ~ 9.8e-4).
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-4,  # bfloat16 executes as float32
             "int32": 0.0}  # indices (argmax) are equal or wrong
# An output whose exact value is (near) zero, such as the gradient of a key bias (softmax is
# shift-invariant), is pure rounding noise in both runs, so its relative error means nothing. Such
# an output passes when the plan is within NOISE_FACTOR times the program's own float32 error
# (its distance from a float64 run of the program): a wrong computation is off by far more.
NOISE_FACTOR = 8.0


@dataclass
class VerifyReport:
    ok: bool
    max_rel_error: float
    tolerance: float
    per_output: dict[str, float] = field(default_factory=dict)
    problems: list[str] = field(default_factory=list)  # interface differences (then nothing ran)
    # outputs judged against the program's own rounding error (NOISE_FACTOR): name -> that error
    rounding: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        if self.problems:
            return f"{verdict}: the plan does not compute the program's tensors: " + "; ".join(self.problems)
        rows = ", ".join(f"{k}: {v:.2e}" for k, v in self.per_output.items())
        noise = "".join(f"; {k} is rounding noise in the program itself (its float32 error {v:.1e}), so it is "
                        f"judged against {NOISE_FACTOR:g}x that" for k, v in self.rounding.items())
        return f"{verdict}: max relative error {self.max_rel_error:.2e} (tolerance {self.tolerance:.0e}; {rows}{noise})"


def rel_error(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if a.shape != ref.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(a - ref))) / scale


def rounding_error(a: np.ndarray, ref: np.ndarray, exact: np.ndarray, tol: float) -> tuple[float, float]:
    """(relative error, the reference's own error) of ``a`` against ``ref``, for an output whose
    ``ref`` is ``exact`` (the program in float64) rounded: the scale is raised so that an error
    within ``NOISE_FACTOR`` times the reference's own error from ``exact`` is within ``tol``."""
    a, ref, exact = (np.asarray(v, np.float64) for v in (a, ref, exact))
    own = float(np.max(np.abs(ref - exact))) if ref.size else 0.0
    scale = max(float(np.max(np.abs(ref))) if ref.size else 0.0, NOISE_FACTOR * own / tol, 1e-30)
    return float(np.max(np.abs(a - ref))) / scale if a.size else 0.0, own


def interface_problems(g: Graph, ref: Graph) -> list[str]:
    """How ``g``'s sources and outputs differ from ``ref``'s (names, shapes, dtypes, roles)."""
    def face(x: Graph) -> dict[str, tuple]:
        return {n: (t.shape, t.dtype, t.role) for n, t in x.tensors.items()
                if t.role in SOURCE_ROLES or t.role == "output"}

    mine, want = face(g), face(ref)
    out = [f"{what} {n!r} of the program is missing" for n, (_, _, what) in want.items() if n not in mine]
    out += [f"{what} {n!r} is not in the program" for n, (_, _, what) in mine.items() if n not in want]
    out += [f"{n!r} is {mine[n][1]}{list(mine[n][0])} ({mine[n][2]}), the program's is "
            f"{want[n][1]}{list(want[n][0])} ({want[n][2]})" for n in mine.keys() & want.keys() if mine[n] != want[n]]
    return sorted(out)


def execution_cost(g: Graph) -> tuple[float, float]:
    """(bytes of every tensor, FLOPs of every op) of one execution of ``g``."""
    nbytes = sum(math.prod(t.shape) * ITEMSIZE.get(t.dtype, 8) for t in g.tensors.values())
    flops = 0.0
    for o in g.ops.values():
        sig = g.signature(o)
        flops += float(math.prod(sig.extents)) * float(sig.flops_per_point)
    return float(nbytes), flops


def check_execution_size(g: Graph, ref: Graph, max_bytes: float = MAX_BYTES, max_flops: float = MAX_FLOPS) -> None:
    """``ExecutionTooLarge`` unless running ``g`` and ``ref`` stays within the bounds."""
    (b1, f1), (b2, f2) = execution_cost(g), execution_cost(ref)
    if b1 + b2 > max_bytes or f1 + f2 > max_flops:
        raise ExecutionTooLarge(
            f"running the plan and its program needs {(b1 + b2) / 1e9:.3g} GB of tensors and {f1 + f2:.3g} FLOPs; "
            f"verify runs at most {max_bytes / 1e9:.3g} GB and {max_flops:.3g} FLOPs (--max-bytes, --max-flops "
            f"raise the bounds; or verify the same plan on a smaller instance of the program)")


def verify(g: Graph, seed: int = 0, reference: Graph | None = None, backend: str = "numpy",
           values: Mapping[str, np.ndarray] | None = None, max_bytes: float = MAX_BYTES,
           max_flops: float = MAX_FLOPS) -> VerifyReport:
    """Compare ``g`` against ``reference`` (default: ``unshard(g)``) on seeded random inputs.

    ``values``: arrays for named source tensors (an imported model's weights, ``program.npz``);
    they replace the random draws of those tensors.
    """
    ref_graph = unshard(g) if reference is None else reference
    problems = interface_problems(g, ref_graph)
    if problems:
        return VerifyReport(False, float("inf"), TOLERANCE["float32"], {}, problems)
    check_execution_size(g, ref_graph, max_bytes, max_flops)
    inputs = random_inputs(ref_graph, seed)
    inputs.update({n: np.asarray(v) for n, v in (values or {}).items() if n in inputs})
    plan = execute(g, inputs, backend)
    ref = execute(ref_graph, inputs, "numpy")
    per = {n: rel_error(to_numpy(plan[n]), to_numpy(ref[n])) for n in outputs(ref_graph)}
    dtypes = {ref_graph.tensors[n].dtype for n in per}
    tol = max(TOLERANCE[d] for d in dtypes) if dtypes else TOLERANCE["float32"]
    rounding: dict[str, float] = {}
    noisy = [n for n, v in per.items() if v > tol and TOLERANCE[ref_graph.tensors[n].dtype] > 0]
    if noisy:  # only then is the program run again, in float64
        exact = execute(ref_graph, inputs, "numpy", precision="float64")
        for n in noisy:
            err, own = rounding_error(to_numpy(plan[n]), to_numpy(ref[n]), exact[n], tol)
            if err < per[n]:
                per[n], rounding[n] = err, own
    # NaN compares false with everything: max() would skip it and a NaN output would PASS
    worst = max(per.values(), key=lambda v: (np.isnan(v), v)) if per else 0.0
    return VerifyReport(bool(worst <= tol), worst, tol, per, rounding=rounding)
