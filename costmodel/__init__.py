"""Cost model: hardware presets, lowering to flat arrays, the numba schedule simulator,
objectives and lower bounds, calibration from measurements."""

from costmodel.evaluate import OBJECTIVES, Evaluation, Evaluator, evaluate, lower_bound
from costmodel.hardware import Hardware, HardwareError, load_hardware, save_hardware

__all__ = ["OBJECTIVES", "Evaluation", "Evaluator", "Hardware", "HardwareError", "evaluate", "load_hardware",
           "lower_bound", "save_hardware"]
