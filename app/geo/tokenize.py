"""Keyword tokenising for objects and subscriptions (Tornado §3.2 keyword predicates).

Both sides of a match go through the same normalisation so OVERLAPS/CONTAINS compare like terms.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# \w is Unicode-aware in Python 3; excluding "_" makes the underscore a separator.
_TOKEN = re.compile(r"[^\W_]+")


def tokenize(text: str) -> list[str]:
    """Lower-cased runs of Unicode letters and digits, de-duplicated, in first-seen order.

    Lower-casing happens first, so every token re-tokenises to itself (e.g. "İ" lower-cases
    to "i" + a combining dot, which is a separator).
    """
    return list(dict.fromkeys(_TOKEN.findall(text.lower())))


def normalize_keywords(kws: Iterable[str]) -> list[str]:
    """Lower-case and de-duplicate client-given keywords, preserving order; drops empties."""
    out = dict.fromkeys(map(str.lower, kws))
    out.pop("", None)
    return list(out)
