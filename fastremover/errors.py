"""The one exception type for problems a user can cause (bad input, missing files, wrong flags).

The CLI turns it into a single line on stderr and a non-zero exit code; the Python API lets it propagate.
Internal bugs stay ordinary exceptions so they keep their tracebacks.
"""


class FastRemoverError(Exception):
    """A problem with the user's input or environment, with a message that says what to do."""
