"""A chi-square goodness-of-fit check without SciPy."""

from __future__ import annotations

import math

import numpy as np

Z_ONE_IN_A_THOUSAND = 3.0902  # upper 0.1% point of the standard normal


def chi_square_critical(df: int, z: float = Z_ONE_IN_A_THOUSAND) -> float:
    """Wilson-Hilferty approximation of the chi-square quantile (accurate to ~1% for df >= 3)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * math.sqrt(a)) ** 3


def chi_square_fits(counts: np.ndarray, probs: np.ndarray, min_expected: float = 5.0) -> tuple[bool, float, float]:
    """Does `counts` fit `probs`? False alarm rate 0.1%. Cells with tiny expectation are pooled."""
    counts = np.asarray(counts, dtype=np.float64).ravel()
    probs = np.asarray(probs, dtype=np.float64).ravel()
    n = counts.sum()
    expected = probs / probs.sum() * n
    if np.any((expected == 0) & (counts > 0)):
        return False, math.inf, 0.0  # a sample where the target has no mass
    big = expected >= min_expected
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    keep = exp > 0
    obs, exp = obs[keep], exp[keep]
    stat = float(((obs - exp) ** 2 / exp).sum())
    df = max(1, len(obs) - 1)
    crit = chi_square_critical(df)
    return stat <= crit, stat, crit
