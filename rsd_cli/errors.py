class RsdError(Exception):
    """A problem the user can fix; printed as one line, exit code 1."""


class UsageError(RsdError):
    """Bad command-line input; exit code 2."""
