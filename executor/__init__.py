"""Execution of block graphs on NumPy (and CuPy): shard by shard, checked against the original."""

from executor.backend import BACKENDS, BackendError, get_backend
from executor.run import execute, random_inputs
from executor.verify import TOLERANCE, VerifyReport, verify

__all__ = ["BACKENDS", "BackendError", "TOLERANCE", "VerifyReport", "execute", "get_backend", "random_inputs",
           "verify"]
