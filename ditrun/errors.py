"""The one error type for mistakes a user can fix.

A ``UserError`` is a config key, input file or cluster setting that the user got wrong; the
command prints its message as one sentence and exits 2. Every other exception is a bug or a
failure of the machine and shows its traceback, so a real bug is never disguised as a
misleading one-line "mistake".
"""


class UserError(ValueError):
    """A mistake the user can fix; the message is one sentence naming the key, file or edit and what is allowed."""
