"""Tokeniser and keyword normalisation (Tornado §3.2 keyword predicates)."""

from hypothesis import given
from hypothesis import strategies as st

from app.geo.tokenize import normalize_keywords, tokenize


def test_tokenize_basic() -> None:
    assert tokenize("Hello, hello WORLD! 42nd_street café-Crème") == [
        "hello",
        "world",
        "42nd",
        "street",
        "café",
        "crème",
    ]


def test_tokenize_unicode_and_empty() -> None:
    assert tokenize("東京 Straße ΑΘΉΝΑ") == ["東京", "straße", "αθήνα"]
    assert tokenize("") == []
    assert tokenize("__ -- !!") == []


def test_normalize_keywords() -> None:
    assert normalize_keywords(["Coffee", "tea", "COFFEE", "", "Tea"]) == ["coffee", "tea"]


@given(st.text())
def test_tokens_are_clean_and_unique(text: str) -> None:
    toks = tokenize(text)
    assert len(toks) == len(set(toks))
    for t in toks:
        assert t and "_" not in t
        assert all(c.isalnum() for c in t)
        assert tokenize(t) == [t]
