"""Generated programs and framework placements for plans.

- ``generate_program(g, transfers, residency, order)``: the source of a standalone Python
  program running the plan, one process per device (``executor.codegen.program``);
- ``dtensor_placements(g, residency, mesh=None)``: per tensor, PyTorch DTensor placements over
  a 1-D or 2-D device mesh where the plan is expressible as such (``executor.codegen.dtensor``).

Generated programs run with ``--backend numpy`` (host processes and queues), ``cupy`` or
``torch`` (``torch.distributed`` send/recv: gloo on the host, NCCL between GPUs).
"""

from executor.codegen.program import CodegenError, default_order, generate_program

__all__ = ["CodegenError", "default_order", "generate_program"]
