"""The one exception type for user mistakes.

Anything the user can fix (a wrong path, an impossible option, too little data) raises `UserError`
with a one-line message that names the problem and the fix. The CLI prints it as `error: …` and
exits with status 2; every other exception is an internal error (status 1, traceback kept).
"""


class UserError(Exception):
    """A problem in the user's input, with the fix in its message."""
