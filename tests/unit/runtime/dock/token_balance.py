"""How evenly a split of samples levels token counts over ranks: the measure the balance tests hold
the dock's hand-out to."""

from __future__ import annotations

import numpy as np


def imbalance(tokens: np.ndarray, parts: list[np.ndarray]) -> float:
    """Largest relative deviation of a rank's token total from the mean (0.0 means perfect)."""
    totals = np.array([np.asarray(tokens)[part].sum() for part in parts], dtype=np.float64)
    mean = totals.mean()
    return float(np.abs(totals - mean).max() / mean) if mean > 0 else 0.0
