"""Generated programs and framework placements for plans.

- ``generate_program(g, transfers, residency, order)``: the source of a standalone Python
  program running the plan, one process per device (``executor.codegen.program``);
- ``dtensor_placements(g, mesh)``: per tensor, PyTorch DTensor placements over a named device
  mesh where the plan is expressible as such (``executor.codegen.dtensor``).
"""

from executor.codegen.program import CodegenError, default_order, generate_program

__all__ = ["CodegenError", "default_order", "generate_program"]
