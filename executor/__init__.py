"""Execution of block graphs on NumPy (and CuPy): shard by shard, checked against the original."""

from executor.backend import BACKENDS, BackendError, get_backend
from executor.device_run import DeviceRunResult, IncompleteCommunication, run_on_devices
from executor.run import execute, random_inputs
from executor.verify import TOLERANCE, VerifyReport, verify

__all__ = ["BACKENDS", "BackendError", "DeviceRunResult", "IncompleteCommunication", "TOLERANCE", "VerifyReport",
           "execute", "get_backend", "random_inputs", "run_on_devices", "verify"]
