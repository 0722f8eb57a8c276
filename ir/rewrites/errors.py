"""The one exception every rewrite raises when it refuses."""


class RewriteError(ValueError):
    """A rewrite does not apply to this graph; the message says why."""
