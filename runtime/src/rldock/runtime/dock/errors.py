"""Errors the transfer dock raises to its callers."""

from __future__ import annotations


class DockTimeoutError(TimeoutError):
    """A consumer waited longer than its timeout for ready samples.

    The message names the worker state, the rank, the columns it waits for and how many samples
    are ready, not ready and remaining, so a stuck pipeline says which producer is missing.
    """


class DockActorDiedError(RuntimeError):
    """A warehouse, controller or central buffer of the dock is dead.

    The message names the actor (and, for a warehouse, the samples it held). The dock's data for
    this iteration is gone, so the job fails at once and its retry resumes from the last
    checkpoint, rather than consumers waiting for samples that will never come.
    """
