"""Errors that carry a message meant for the user.

The command line prints a ``UserError`` as one line (``scratchlm <command>: error: ...``)
with no traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations


class UserError(Exception):
    """Bad input from the user: a missing file, a bad option, an impossible config."""
