"""The operator dashboard (`GET /admin/`): one self-contained HTML page over the admin API.

The page itself holds no data and needs no key; it asks the operator for the admin key, keeps
it in sessionStorage and sends it on every call to /v1/admin/*, which do the authorisation."""

from __future__ import annotations

from functools import lru_cache
from importlib.resources import files

from fastapi import APIRouter
from fastapi.responses import HTMLResponse, Response

router = APIRouter(tags=["admin"])

# Everything is inline: no script, style or font may come from anywhere else, and no other
# site may frame the page (it holds an admin key).
HEADERS = {
    "Content-Security-Policy": "default-src 'none'; script-src 'unsafe-inline'; "
    "style-src 'unsafe-inline'; connect-src 'self'; img-src 'self' data:; "
    "frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}


@lru_cache(maxsize=1)
def dashboard_html() -> str:
    return files("app").joinpath("static").joinpath("dashboard.html").read_text(encoding="utf-8")


@router.get("/admin/", response_class=HTMLResponse)
async def dashboard() -> HTMLResponse:
    """The operator dashboard: cluster, balancer, partitions map and recent rounds."""
    return HTMLResponse(dashboard_html(), headers=HEADERS)


@router.get("/favicon.ico", include_in_schema=False)
async def favicon() -> Response:
    """No icon: a browser showing the dashboard asks for one, and a 404 would be logged in its
    console as an error."""
    return Response(status_code=204, headers={"Cache-Control": "max-age=86400"})
