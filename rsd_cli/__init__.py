"""rsd: Recursive Speculative Decoding from the command line."""

__version__ = "0.1.0"
