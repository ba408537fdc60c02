"""The errors planning raises: a model that cannot be planned, a plan file that does not parse."""


class PlanError(ValueError):
    """The model cannot be planned on this mesh; the message says why and what would work."""


class PlanFormatError(ValueError):
    """A plan file that is malformed or does not fit the model; the message names the field."""
