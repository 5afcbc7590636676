"""The errors grpo_hf raises for bad input: one base class, one subclass per kind of input, each naming the culprit.

Every error is a `ValueError`, so code that catches the Trainer's `ValueError`s keeps working; the `grpo-hf` command
line catches [`GRPOInputError`] once and prints its message (what is wrong, where, how to fix it) as one
`grpo-hf <command>: error: ...` line on stderr, exit status 2, without a traceback (`--debug` shows it).

| error | raised for | the message names |
|---|---|---|
| [`ConfigError`] | a `GRPOConfig` field, or a backend GRPO cannot run on | the field |
| [`GroupConfigError`] | a group file or rule | the file and the rule |
| [`CheckpointError`] | a checkpoint folder or a GRPO state file | the folder or file |
| [`OutputDirError`] | an `output_dir` holding another run | the folder and what it holds |
| [`MissingPathError`] | a file or folder named on the command line that does not exist (also a `FileNotFoundError`) | the path |
| [`~grpo_hf.parser.RecipeError`] | a recipe file, a command-line override, or the data a recipe names | the recipe, the field |
"""


class GRPOInputError(ValueError):
    """Base class of the errors grpo_hf raises for bad input; the message says what is wrong, where, and the fix."""


class ConfigError(GRPOInputError):
    """A `GRPOConfig` field (or the backend it asks for) is invalid; the message names the field."""


class GroupConfigError(GRPOInputError):
    """A group file or rule is invalid; the message names the file, the rule and the fix."""


class CheckpointError(GRPOInputError):
    """A checkpoint cannot be resumed from (missing, incomplete, corrupt or from another setup); names the file."""


class OutputDirError(GRPOInputError):
    """An `output_dir` holds another run's results, model or checkpoints; the message lists them and the ways out."""


class MissingPathError(GRPOInputError, FileNotFoundError):
    """A file or folder the input names does not exist; the message names it and what it should be."""


__all__ = [
    "CheckpointError",
    "ConfigError",
    "GRPOInputError",
    "GroupConfigError",
    "MissingPathError",
    "OutputDirError",
]
