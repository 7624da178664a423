"""Errors raised below the training side too (compat's guarded loader), so they live where every part can import them."""


class CheckpointError(ValueError):
    """A checkpoint cannot be resumed from: missing, incomplete, crafted, or made by a run this one is not."""
