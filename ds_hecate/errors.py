"""Exceptions ds_hecate raises. Each names what is wrong; docs/troubleshooting.md lists them."""


class HecateError(RuntimeError):
    """Base class: a ds_hecate setup or runtime error."""


class HecateConfigError(HecateError, ValueError):
    """The ``hecate`` config section (or its combination with the rest of the DeepSpeed config) is invalid."""


class HecateUnsupportedError(HecateError):
    """A DeepSpeed mode Hecate does not support (yet) was requested together with Hecate."""


class HecateModelError(HecateError):
    """The model has no MoE layer Hecate can take over, or one it cannot convert."""


class HecateCollectiveError(HecateError):
    """One of Hecate's collectives failed or timed out, almost always because another rank died or stopped."""
