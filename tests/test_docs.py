"""The user documentation in docs/ stays true to the code: the endpoints of docs/api.md are the
app's, every setting is in docs/operations.md, and every link leads somewhere. Fast: no server,
no Redis (the app is only built, for its OpenAPI document)."""

from __future__ import annotations

import re
import subprocess
import unicodedata
from pathlib import Path

import pytest

from app.core.config import Settings
from app.main import create_app

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
API_DOC = DOCS / "api.md"
OPERATIONS_DOC = DOCS / "operations.md"
METHODS = ("get", "put", "post", "delete", "patch")

# docs/api.md documents each available endpoint under a heading `METHOD /path`; endpoints that
# are only planned are named in running text, never in such a heading.
ENDPOINT_HEADING = re.compile(r"^#{2,6} `(GET|PUT|POST|DELETE|PATCH) (/[^`\s]*)`", re.MULTILINE)
# Served by the app but not part of its OpenAPI document (the WebSocket), or documented there
# only as HTML (the dashboard).
BEYOND_OPENAPI = {("GET", "/v1/stream"), ("GET", "/admin/")}


def _shape(path: str) -> str:
    """Path parameter names are the code's business: `{sub_id}` and `{id}` are one path."""
    return re.sub(r"\{[^}]*\}", "{}", path)


def _openapi_endpoints() -> set[tuple[str, str]]:
    doc = create_app(Settings()).openapi()
    return {(method.upper(), _shape(path)) for path, item in doc["paths"].items()
            for method in item if method in METHODS}


def _documented_endpoints() -> set[tuple[str, str]]:
    text = API_DOC.read_text(encoding="utf-8")
    return {(method, _shape(path)) for method, path in ENDPOINT_HEADING.findall(text)}


def test_every_endpoint_of_the_app_is_documented() -> None:
    missing = _openapi_endpoints() - _documented_endpoints()
    assert not missing, f"endpoints without a `METHOD /path` heading in docs/api.md: {missing}"


def test_every_documented_endpoint_exists() -> None:
    extra = _documented_endpoints() - _openapi_endpoints() - BEYOND_OPENAPI
    assert not extra, f"docs/api.md documents endpoints the app does not serve: {extra}"


def test_every_setting_is_documented() -> None:
    text = OPERATIONS_DOC.read_text(encoding="utf-8")
    names = {f"GEOSWARM_{field.upper()}" for field in Settings.model_fields}
    missing = sorted(n for n in names if f"`{n}`" not in text)
    assert not missing, f"settings missing from docs/operations.md: {missing}"
    stale = sorted(set(re.findall(r"GEOSWARM_[A-Z0-9_]*[A-Z0-9]", text)) - names)
    assert not stale, f"docs/operations.md names settings that do not exist: {stale}"


def _tracked_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True,
                             check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    files = [ROOT / name for name in out.decode().split("\0") if name]
    # The docs are checked even before they are first committed.
    files += [ROOT / "README.md", *DOCS.glob("*.md")]
    return sorted({f for f in files if f.is_file()})


def test_no_link_leaves_the_repository_for_the_old_documents() -> None:
    # Built from parts so that this file does not match itself.
    needles = [s.encode() for s in ("../" + "shared", "shared/" + "API.md",
                                    "shared/" + "DESIGN.md")]
    offenders = [str(f.relative_to(ROOT)) for f in _tracked_files()
                 if any(n in f.read_bytes() for n in needles)]
    assert not offenders, f"files that point outside the repository for documentation: {offenders}"


# --- links ----------------------------------------------------------------------------------

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INLINE_CODE = re.compile(r"`[^`\n]*`")
INLINE_LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEFINITION = re.compile(r"^\s{0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s.*)?$", re.MULTILINE)
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)


def _prose(text: str) -> str:
    return INLINE_CODE.sub("", FENCE.sub("", text))


def _anchors(path: Path) -> set[str]:
    """The anchors GitHub gives the headings of a Markdown file: lower case, punctuation other
    than `-` and `_` dropped, spaces to `-`, and `-1`, `-2`, … for repeats."""
    seen: dict[str, int] = {}
    anchors = set()
    for heading in HEADING.findall(FENCE.sub("", path.read_text(encoding="utf-8"))):
        heading = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link's text stays
        slug = "".join(c for c in heading.lower()
                       if c in " -_" or unicodedata.category(c)[0] in "LN").replace(" ", "-")
        n = seen.get(slug, 0)
        seen[slug] = n + 1
        anchors.add(slug if n == 0 else f"{slug}-{n}")
    return anchors


def _link_files() -> list[Path]:
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def test_the_documents_exist() -> None:
    for name in ("api.md", "architecture.md", "operations.md"):
        assert (DOCS / name).is_file(), f"docs/{name} is missing"


@pytest.mark.parametrize("doc", _link_files(), ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_lead_to_existing_files(doc: Path) -> None:
    text = _prose(doc.read_text(encoding="utf-8"))
    targets = INLINE_LINK.findall(text) + REFERENCE_DEFINITION.findall(text)
    broken = []
    for target in targets:
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE) or target.startswith("//"):
            continue  # http:, https:, mailto:: not ours to check offline
        file_part, _, anchor = target.partition("#")
        dest = (doc.parent / file_part).resolve() if file_part else doc
        if not dest.exists() or not dest.is_relative_to(ROOT):
            broken.append(target)
        elif anchor and dest.suffix == ".md" and anchor not in _anchors(dest):
            broken.append(target)
    assert not broken, f"links in {doc.relative_to(ROOT)} that lead nowhere: {broken}"
