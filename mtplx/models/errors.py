"""Why a checkpoint could not be loaded (the loader and the architecture files both raise these)."""


class ModelLoadError(ValueError):
    """A checkpoint could not be loaded; the message says what to fix."""


class ModelNotFoundError(ModelLoadError, FileNotFoundError):
    pass


class UnsupportedModelError(ModelLoadError):
    pass


class CheckpointShapeError(ModelLoadError):
    pass
