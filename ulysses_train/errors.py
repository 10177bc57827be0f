"""The one base class of mistakes a user can fix.

Every error the package raises for bad input (a config key, a file, a flag, a layout, a checkpoint, a plan that
does not fit) derives from `UserError`, and its message names the problem and the fix. Every entry point turns
it into one `error: ...` line on stderr and exit code `EXIT_USER_ERROR`, never a traceback
(`ulysses_train.cli.report_user_errors`).
"""

EXIT_USER_ERROR = 2


class UserError(Exception):
    """Bad input: the message says what is wrong and how to fix it."""


class ConfigError(UserError, ValueError):
    """A configuration value is missing or invalid; the message names the key and the fix."""
