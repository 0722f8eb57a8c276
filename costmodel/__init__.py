"""Cost model: hardware presets, lowering to flat arrays, the numba schedule simulator,
objectives and lower bounds, calibration from measurements."""

from costmodel.calibrate import calibrate, measurements_for
from costmodel.evaluate import (OBJECTIVES, Breakdown, Evaluation, Evaluator, breakdown, evaluate, lower_bound,
                                serial_prediction)
from costmodel.hardware import Hardware, HardwareError
from costmodel.hardware_io import load_hardware, save_hardware

__all__ = ["OBJECTIVES", "Breakdown", "Evaluation", "Evaluator", "Hardware", "HardwareError", "breakdown", "calibrate",
           "evaluate", "load_hardware", "lower_bound", "measurements_for", "save_hardware", "serial_prediction"]
