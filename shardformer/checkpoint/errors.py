"""The one error type of checkpoint saving and loading: its message names the file and what is wrong."""


class CheckpointError(ValueError):
    """A checkpoint or model folder cannot be written or read as asked; nothing was changed."""
