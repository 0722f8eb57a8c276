"""``verify``: run a plan and the unsharded original on the same inputs and compare outputs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

import numpy as np

from executor.backend import to_numpy
from executor.run import execute, outputs, random_inputs
from ir.graph import Graph
from ir.rewrites import unshard

# Relative error bounds (max |plan - ref| / max |ref|): summation order changes under reduction
# splits, so the bound scales with the storage dtype's unit roundoff (float16 eps ~ 9.8e-4).
TOLERANCE = {"float32": 1e-4, "float16": 2e-2, "bfloat16": 1e-4}  # bfloat16 executes as float32


@dataclass
class VerifyReport:
    ok: bool
    max_rel_error: float
    tolerance: float
    per_output: dict[str, float] = field(default_factory=dict)

    def __str__(self) -> str:
        verdict = "PASS" if self.ok else "FAIL"
        rows = ", ".join(f"{k}: {v:.2e}" for k, v in self.per_output.items())
        return f"{verdict}: max relative error {self.max_rel_error:.2e} (tolerance {self.tolerance:.0e}; {rows})"


def rel_error(a: np.ndarray, ref: np.ndarray) -> float:
    a, ref = np.asarray(a, np.float64), np.asarray(ref, np.float64)
    if a.shape != ref.shape:
        return float("inf")
    scale = max(float(np.max(np.abs(ref))), 1e-30)
    return float(np.max(np.abs(a - ref))) / scale


def verify(g: Graph, seed: int = 0, reference: Graph | None = None, backend: str = "numpy",
           values: Mapping[str, np.ndarray] | None = None) -> VerifyReport:
    """Compare ``g`` against ``reference`` (default: ``unshard(g)``) on seeded random inputs.

    ``values``: arrays for named source tensors (an imported model's weights, ``program.npz``);
    they replace the random draws of those tensors.
    """
    ref_graph = unshard(g) if reference is None else reference
    inputs = random_inputs(ref_graph, seed)
    inputs.update({n: np.asarray(v) for n, v in (values or {}).items() if n in inputs})
    plan = execute(g, inputs, backend)
    ref = execute(ref_graph, inputs, "numpy")
    per = {n: rel_error(to_numpy(plan[n]), to_numpy(ref[n])) for n in outputs(ref_graph)}
    dtypes = {ref_graph.tensors[n].dtype for n in per}
    tol = max(TOLERANCE[d] for d in dtypes) if dtypes else TOLERANCE["float32"]
    # NaN compares false with everything: max() would skip it and a NaN output would PASS
    worst = max(per.values(), key=lambda v: (np.isnan(v), v)) if per else 0.0
    return VerifyReport(bool(worst <= tol), worst, tol, per)
