"""The one error type decode raises."""


class WireError(ValueError):
    """A payload failed validation. The message names the field or record that is wrong."""
