"""Errors raised while finding, reading or building a model."""


class ModelLoadError(Exception):
    """A checkpoint cannot be used; the message says why in one line."""


class UnsupportedModelError(ModelLoadError):
    """config.json names an architecture no registered family serves."""
