"""Reverse-mode autodiff on the block IR: training steps as ordinary graphs.

- ``rules``: one vector-Jacobian rule per kernel (the ``RULES`` table), emitting block ops;
- ``reverse``: the reverse walk (fan-out gradients summed);
- ``optimizers``: SGD (momentum) and AdamW update ops over each parameter's index space;
- ``step``: ``training_step(g, loss=..., optimizer=...)`` = forward + loss + backward + update.
"""

from ir.autodiff.errors import AutodiffError
from ir.autodiff.optimizers import OPTIMIZERS
from ir.autodiff.reverse import backward
from ir.autodiff.rules import RULES, VJP
from ir.autodiff.step import LOSSES, training_step

__all__ = ["AutodiffError", "LOSSES", "OPTIMIZERS", "RULES", "VJP", "backward", "training_step"]
