"""`JaxrlError`: the base of every error jaxrl raises for bad input or a stopped run.

The command line catches it once and prints `jaxrl: <kind>: <message>`, exiting with `exit_code`.
"""


class JaxrlError(Exception):
    """An error the user can act on: the message names the config field, file and line where known."""

    kind = "error"  # the label the command line prints before the message
    exit_code = 2  # bad input
