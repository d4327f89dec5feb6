"""Keyword tokenising: lower-cased runs of letters and digits (API.md, objects)."""
from __future__ import annotations

import re
from collections.abc import Iterable

_TOKEN = re.compile(r"[^\W_]+")
def tokenize(text: str) -> list[str]:
    return list(dict.fromkeys(_TOKEN.findall(text.lower())))
def normalize_keywords(kws: Iterable[str]) -> list[str]:
    return list(dict.fromkeys(k.lower() for k in kws))
