"""Search strategies (driver side): the native island evolution, random search, Optuna."""
