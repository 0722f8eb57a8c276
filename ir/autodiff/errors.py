"""The error autodiff raises for programs it cannot differentiate."""


class AutodiffError(ValueError):
    """The program cannot be differentiated as asked; the message names the op or tensor and why."""
