"""The errors a user can cause. Each message names the file and line, the config key or the tensor, and what is
accepted; `python -m jalign.run` prints it as `error: <message>` and exits 2 without a traceback. Any other exception
is a fault of jalign's and keeps its traceback."""


class UserError(ValueError):
  """Input the user supplied (config, data, checkpoint, tokenizer, prompt, reward) that cannot be used."""


class ConfigError(UserError):
  """A run or model config key that jalign cannot honour."""


class DataError(UserError):
  """A record or data file that cannot be used; the message names the file and line/row and the reason."""


class CheckpointError(UserError):
  """A checkpoint file that cannot be used; the message names the file and tensor."""
