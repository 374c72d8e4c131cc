"""The error every data reader raises."""


class DataError(ValueError):
  """A record or data file that cannot be used; the message names the file and line/row and the reason."""
