"""`allowed_methods` remembers each path's methods (every request with a body asks), and
forgets them all past a bound, so that made-up paths cannot grow the process."""

from __future__ import annotations

from pathlib import Path

from app.core.config import Settings
from app.main import _ALLOWED, _ALLOWED_PATHS, _route_methods, allowed_methods, create_app


def test_remembered_methods_are_the_routes_methods(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))
    paths = ["/v1/queries", "/v1/queries/q0", "/v1/objects", "/v1/subscriptions/batch",
             "/v1/subscriptions/s_1", "/v1/subscriptions", "/v1/admin/balancer", "/nowhere"]
    for _ in range(2):  # computed, then remembered
        for path in paths:
            assert allowed_methods(app, path) == _route_methods(app, path)
    assert allowed_methods(app, "/v1/queries") == ["POST"]
    assert allowed_methods(app, "/v1/subscriptions/s_1") == ["DELETE", "GET"]
    assert allowed_methods(app, "/nowhere") == []


def test_made_up_paths_do_not_grow_it_past_its_bound(tmp_path: Path) -> None:
    app = create_app(Settings(data_dir=tmp_path))
    for i in range(_ALLOWED_PATHS + 100):
        assert allowed_methods(app, f"/v1/subscriptions/s_{i}") == ["DELETE", "GET"]
    assert 0 < len(_ALLOWED[app]) <= _ALLOWED_PATHS
    assert allowed_methods(app, "/v1/objects") == _route_methods(app, "/v1/objects")
