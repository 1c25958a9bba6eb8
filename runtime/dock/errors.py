"""Errors the transfer dock raises to its callers."""

from __future__ import annotations


class DockTimeoutError(TimeoutError):
    """A consumer waited longer than its timeout for ready samples.

    The message names the worker state, the rank, the columns it waits for and how many samples
    are ready, not ready and remaining, so a stuck pipeline says which producer is missing.
    """
