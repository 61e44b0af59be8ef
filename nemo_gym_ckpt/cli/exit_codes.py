"""Exit codes of every command, and the one map from exceptions to them.

    0   OK             done
    1   FAILURE        a failure, said in one line
    2   USAGE          a usage or config error (nothing was started)
    75  CHECKPOINTED   checkpointed and stopped on request (SIGTERM to ``collect``)
    130 INTERRUPTED    stopped by Ctrl-C

``exit_code_for`` walks an exception's classes and answers the code of the first one in
``EXIT_CODES``: the ``CommandError`` family and ``GymError`` (a mesh error that reached a command)
each have one.
"""

from __future__ import annotations

from enum import IntEnum

from nemo_gym_ckpt.errors import CollectFailed, ConfigError, GymError, LaunchError, UsageError

__all__ = ["EXIT_CODES", "ExitCode", "exit_code_for"]


class ExitCode(IntEnum):
    OK = 0
    FAILURE = 1
    USAGE = 2
    CHECKPOINTED = 75
    INTERRUPTED = 130


EXIT_CODES: dict[type[BaseException], ExitCode] = {
    ConfigError: ExitCode.USAGE,
    UsageError: ExitCode.USAGE,
    LaunchError: ExitCode.FAILURE,
    CollectFailed: ExitCode.FAILURE,
    GymError: ExitCode.FAILURE,
    KeyboardInterrupt: ExitCode.INTERRUPTED,
}


def exit_code_for(error: BaseException) -> ExitCode:
    """The exit code of ``error``: that of its nearest class in ``EXIT_CODES``, else ``FAILURE``."""
    for cls in type(error).__mro__:
        if cls in EXIT_CODES:
            return EXIT_CODES[cls]
    return ExitCode.FAILURE
