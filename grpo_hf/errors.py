"""Every error class of grpo_hf: the input errors (one base class, one subclass per kind of input, each naming the
culprit), the Hub's, and the energy meters'; and [`warn_once`], the one way grpo_hf says a warning once.

Every input error is a `ValueError`, so code that catches the Trainer's `ValueError`s keeps working; the `grpo-hf`
command line catches [`GRPOInputError`] once and prints its message (what is wrong, where, how to fix it) as one
`grpo-hf <command>: error: ...` line on stderr, exit status 2, without a traceback (`--debug` or `GRPO_HF_DEBUG=1`
shows it), as it does a library's own refusal of a setting. A failed upload ([`HubError`])
prints the same one line with exit status 1.

| error | raised for | the message names |
|---|---|---|
| [`ConfigError`] | a `GRPOConfig` field, or a backend GRPO cannot run on | the field |
| [`GroupConfigError`] | a group file or rule | the file and the rule |
| [`CheckpointError`] | a checkpoint folder or a GRPO state file | the folder or file |
| [`OutputDirError`] | an `output_dir` holding another run | the folder and what it holds |
| [`MissingPathError`] | a file or folder named on the command line that does not exist (also a `FileNotFoundError`) | the path |
| [`RecipeError`] | a recipe file, a command-line override, or the data a recipe names | the recipe, the field |
| [`RecipeNotFoundError`] | a recipe file that does not exist (also a `FileNotFoundError`) | the path |
| [`PublishInputError`] | a folder `grpo-hf publish` cannot publish (or a damaged record in it), an upload folder that clashes with it, a malformed repository id | the folder or file, the id |

Not input errors: [`GRPOError`] (a run that cannot go on, e.g. steps with NaN/Inf gradients many times in a
row), [`HubError`] (no token, a refused token, an unreachable Hub) and [`EnergyMeterUnavailable`] (an
energy meter cannot measure on this machine; [`~grpo_hf.cost.make_energy_meter`] falls back to the next one).
"""

import logging


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


class RecipeError(GRPOInputError):
    """A recipe file, override or the data it names is invalid; the message names the file, the field and the fix."""


class RecipeNotFoundError(RecipeError, FileNotFoundError):
    """The recipe file does not exist: a [`RecipeError`] and a `FileNotFoundError`."""


class HubError(ValueError):
    """Publishing failed or cannot start; the message says why and what to do, and no token is ever in it."""


class PublishInputError(HubError, GRPOInputError):
    """
    What was given to `grpo-hf publish` cannot be published as is (a folder without a saved model, a malformed
    repository id): a user error, reported like every [`GRPOInputError`] (exit status 2 on the command line). Failures
    of the upload itself (no token, an unreachable Hub) stay [`HubError`] (exit status 1).
    """


class GRPOError(RuntimeError):
    """
    A run cannot go on (not an input error): e.g. many optimizer steps in a row with NaN/Inf gradients, or a NaN made
    by the compression codec from finite gradients. The message names the step, the groups and parameters, and what to
    do.
    """


class EnergyMeterUnavailable(RuntimeError):
    """Raised by an energy meter's constructor when it cannot measure on this machine; the message says why."""


def warn_once(logger: logging.Logger, said: set, key, message: str, level: int = logging.WARNING) -> None:
    """
    Log `message` (a warning; `level` as `logging`'s levels) the first time `key` is seen in `said`, which then holds
    it: once per state, per run or per process, as long as `said` lives. Keyed, not by the message as transformers'
    `logger.warning_once`, because a message names its step or value and must still be said once.
    """
    if key not in said:
        said.add(key)
        logger.log(level, message)


__all__ = [
    "CheckpointError",
    "ConfigError",
    "EnergyMeterUnavailable",
    "GRPOError",
    "GRPOInputError",
    "GroupConfigError",
    "HubError",
    "MissingPathError",
    "OutputDirError",
    "PublishInputError",
    "RecipeError",
    "RecipeNotFoundError",
]
