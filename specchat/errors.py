"""The one base of every failure specchat reports to the user, as llm's `ModelError` is for llm.

`str(e)` of a SpecchatError is one line meant for the user. A command catches the base once
(cli.main: `specchat: error: ...`, exit code 2, no traceback); a chat turn catches it once (one line,
and the chat goes on). Each module raises its own subclass (ConfigError, SourceError, TemplateError,
RpcError, PromptTooLong, ...); BackendError lives here because backend.py and rpc.py both raise it.
"""

from __future__ import annotations


class SpecchatError(Exception):
    """A failure the user can act on; the message is one line."""


class UserError(SpecchatError):
    """Bad input from the user: a flag, a prompt, a file named on the command line."""


class BackendError(SpecchatError):
    """A model could not be loaded or evaluated."""
