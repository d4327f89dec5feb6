"""The operator dashboard (GET /admin/) in a real headless Chromium against a real cluster (api,
two workers and a coordinator): the key, the cluster table, the partitions map, the balancer
settings, a round now, a move and a split, a wrong key, and no error in the browser's console.

Needs Debian's chromium and chromium-driver (/usr/bin/chromium, /usr/bin/chromedriver) and the
`selenium` package of the dev extra; skipped without them. Screenshots go to
$GEOSWARM_DASHBOARD_SHOTS when set (else to the test's tmp_path)."""

from __future__ import annotations

import colorsys
import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from app.core.redis import EmbeddedRedis
from bench.cluster import LiveServer, start_server

pytestmark = pytest.mark.slow

CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"

if not (os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK)):
    pytest.skip(f"no headless browser: {CHROMIUM} and {CHROMEDRIVER} are needed "
                "(Debian packages chromium and chromium-driver)", allow_module_level=True)

webdriver = pytest.importorskip("selenium.webdriver", reason="selenium (dev extra) not installed")

from selenium.common.exceptions import (  # noqa: E402
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service  # noqa: E402
from selenium.webdriver.common.action_chains import ActionChains  # noqa: E402
from selenium.webdriver.common.by import By  # noqa: E402
from selenium.webdriver.common.keys import Keys  # noqa: E402
from selenium.webdriver.support.ui import Select, WebDriverWait  # noqa: E402

CHROME_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                "--disable-background-networking", "--disable-component-update",
                "--disable-sync", "--disable-dev-shm-usage", "--window-size=1400,1600"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, embedded_redis: EmbeddedRedis
            ) -> Iterator[LiveServer]:
    """api + 2 workers + a coordinator with a 2 s balancing period, and some content."""
    s = start_server(tmp_path_factory.mktemp("dashboard"), embedded_redis.url, workers=2,
                     GEOSWARM_BALANCE_PERIOD_S="2")
    try:
        s.start_coordinator()
        s.wait_workers(2)
        tenant = {"Authorization": "Bearer " + s.new_key("acme")}
        for spec in [{"type": "range", "bbox": [-74.02, 40.70, -73.93, 40.80]},
                     {"type": "range", "circle": {"lon": 2.35, "lat": 48.85, "radius_m": 5000}},
                     {"type": "keyword", "keywords": ["coffee"]},
                     {"type": "knn", "point": [139.7, 35.7], "k": 3}]:
            r = httpx.post(s.base_url + "/v1/subscriptions", json=spec, headers=tenant)
            assert r.status_code == 201, r.text
        objects = [{"id": f"taxi-{i}", "lon": -170 + 17 * i, "lat": -60 + 6 * i,
                    "text": "coffee" if i % 2 else "tea"} for i in range(20)]
        r = httpx.post(s.base_url + "/v1/objects", json={"objects": objects}, headers=tenant)
        assert r.status_code == 202, r.text
        yield s
    finally:
        s.stop()


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[Any]:
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROME_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(executable_path=CHROMEDRIVER), options=options)
    driver.set_page_load_timeout(20)
    try:
        yield driver
    finally:
        driver.quit()


def test_dashboard_in_headless_chromium(cluster: LiveServer, browser: Any, tmp_path: Path
                                        ) -> None:
    d = browser
    base, admin = cluster.base_url, cluster.admin()
    shots = Path(os.environ.get("GEOSWARM_DASHBOARD_SHOTS") or tmp_path / "shots")
    shots.mkdir(parents=True, exist_ok=True)
    logs: list[dict[str, Any]] = []

    def get(path: str) -> Any:
        r = httpx.get(base + path, headers=admin, timeout=10)
        r.raise_for_status()
        return r.json()

    def text(element_id: str) -> str:
        found = d.find_elements(By.ID, element_id)
        return str(found[0].text) if found else f"<no #{element_id}>"

    def wait(what: str, check: Callable[[], Any], timeout: float = 8) -> Any:
        try:
            return WebDriverWait(d, timeout, poll_frequency=0.1).until(lambda _: check())
        except TimeoutException:
            d.save_screenshot(str(shots / "failed.png"))
            logs.extend(d.get_log("browser"))
            pytest.fail(f"{what} (within {timeout} s); message {text('message')!r}, status "
                        f"{text('status')!r}, notice {text('notice')!r}, browser log {logs}")

    def use_key(key: str) -> None:
        d.find_element(By.ID, "key-input").send_keys(key)
        d.find_element(By.CSS_SELECTOR, "#key-form button[type=submit]").click()

    def shot(name: str) -> None:
        d.save_screenshot(str(shots / f"{name}.png"))

    def map_point(lon: float, lat: float) -> tuple[float, float]:
        """Where (lon, lat) is on the canvas, in CSS pixels: the page's own projection (the
        plan's bbox fitted into the canvas with 8 px of padding, centred)."""
        x0, y0, x1, y1 = get("/v1/admin/partitions")["bbox"]
        w, h = d.execute_script("const c = arguments[0]; return [c.clientWidth, c.clientHeight];",
                                d.find_element(By.ID, "map"))
        scale = min((w - 16) / (x1 - x0), (h - 16) / (y1 - y0))
        ox, oy = (w - scale * (x1 - x0)) / 2, (h - scale * (y1 - y0)) / 2
        return ox + (lon - x0) * scale, oy + (y1 - lat) * scale

    def pixels(x: float, y: float, w: int = 1, h: int = 1) -> list[list[int]]:
        data = d.execute_script(
            # read from a copy, so that the page's own canvas stays a plain one
            "const c = arguments[0], r = window.devicePixelRatio || 1;"
            "const copy = document.createElement('canvas');"
            "copy.width = c.width; copy.height = c.height;"
            "const ctx = copy.getContext('2d', {willReadFrequently: true});"
            "ctx.drawImage(c, 0, 0);"
            "const px = ctx.getImageData(Math.round(arguments[1] * r),"
            " Math.round(arguments[2] * r), arguments[3], arguments[4]).data;"
            "const out = []; for (let i = 0; i < px.length; i += 4)"
            " out.push([px[i], px[i + 1], px[i + 2], px[i + 3]]); return out;",
            d.find_element(By.ID, "map"), x, y, w, h)
        return [list(p) for p in data]

    def hue(rgb: list[int]) -> float:
        return colorsys.rgb_to_hls(*(c / 255 for c in rgb[:3]))[0] * 360

    def click_partition(pid: str) -> dict[str, Any]:
        feature = next(f for f in get("/v1/admin/partitions")["features"] if f["id"] == pid)
        a, b, c, e = feature["bbox"]
        x, y = map_point((a + c) / 2, b + (e - b) / 4)  # below the label
        canvas = d.find_element(By.ID, "map")
        size = canvas.size
        ActionChains(d).move_to_element_with_offset(
            canvas, int(x - size["width"] / 2), int(y - size["height"] / 2)).click().perform()
        wait(f"{pid} selected", lambda: not d.find_element(By.ID, "sel-some")
             .get_attribute("hidden") and f"partition\n{pid}\n" in text("sel-props") + "\n")
        return feature

    d.get(base + "/admin/")
    assert d.title.startswith("geoswarm")
    assert "enter the admin key" in text("status")
    shot("00-no-key")

    # --- a wrong key, then a tenant key: a clear error, nothing kept, no polling with it
    use_key("not-a-key")
    wait("the refused key is reported", lambda: "refused" in text("notice"))
    assert d.execute_script("return sessionStorage.getItem('geoswarm.adminKey')") is None
    assert text("workers") == "–"
    shot("01-wrong-key")
    use_key(cluster.new_key("acme"))
    wait("the tenant key is reported", lambda: "not an admin key" in text("notice"))

    # --- the admin key: the cluster table fills, the map draws the plan
    use_key(cluster.admin_key)
    wait("the cluster table fills",
         lambda: len(d.find_elements(By.CSS_SELECTOR, "#workers tr td.alive")) == 2)
    assert not d.find_element(By.ID, "notice").is_displayed()
    assert d.execute_script("return sessionStorage.getItem('geoswarm.adminKey')") == \
        cluster.admin_key
    plan = get("/v1/admin/cluster")
    assert text("plan-version") == str(plan["plan_version"])
    rows = text("workers")
    for w in plan["workers"]:
        assert w["id"] in rows
    wait("the legend lists both workers", lambda: "w0 (" in text("legend")
         and "w1 (" in text("legend"))
    features = get("/v1/admin/partitions")["features"]
    assert len(features) >= 2
    # read in one script: the page redraws the legend on every poll, and elements found one
    # call before may be gone the next
    legend = {label.split(" (")[0]: colour for label, colour in d.execute_script(
        "return [...document.querySelectorAll('#legend .swatch')].map(s =>"
        " [s.parentElement.innerText, getComputedStyle(s).backgroundColor]);")}
    hues_by_worker: dict[str, set[int]] = {}
    for f in features:
        a, b, c, e = f["bbox"]
        x, y = map_point((a + c) / 2, b + (e - b) / 4)
        [fill] = pixels(x, y)
        assert fill[3] > 0, f"{f['id']} is not drawn at {x:.0f},{y:.0f}"
        swatch = [int(v) for v in legend[f["properties"]["worker"]]
                  .split("(")[1].rstrip(")").split(",")[:3]]
        gap = abs(hue(fill) - hue(swatch)) % 360
        assert min(gap, 360 - gap) < 12, (f["id"], fill, swatch)  # coloured by its worker
        hues_by_worker.setdefault(f["properties"]["worker"], set()).add(round(hue(fill)))
        # the label (dark text) sits in the middle of the rectangle
        lx, ly = map_point((a + c) / 2, (b + e) / 2)
        box = pixels(lx - 20, ly - 14, 40, 20)
        assert sum(max(p[:3]) < 90 for p in box) > 5, f"no label on {f['id']}"
    assert len(hues_by_worker) == 2
    # the two workers' colours differ
    w0_hues, w1_hues = (hues_by_worker[w] for w in sorted(hues_by_worker))
    assert not w0_hues & w1_hues

    # --- the balancer panel and the rounds table
    wait("the balancer state shows", lambda: text("bal-stage") not in ("", "–")
         and text("bal-leader") not in ("", "–"))
    assert d.find_element(By.ID, "bal-enabled").is_selected()
    assert d.find_element(By.ID, "bal-period").get_attribute("value") == "2"
    wait("the rounds table fills", lambda: len(d.find_elements(By.CSS_SELECTOR, "#rounds tr")) >= 2
         and "auto" in text("rounds"), timeout=10)
    shot("02-loaded")

    # --- PUT /v1/admin/balancer: period and beta, then the enable toggle
    # As a user edits a field: focused, its text selected and typed over. (Selenium's clear()
    # neither focuses it nor fires `input`: a periodic refresh between it and the typing put the
    # old value back, and the typing went after it: 422, beta over 1000, on a slow machine.)
    for field, value in (("bal-period", "3"), ("bal-beta", "25")):
        box = d.find_element(By.ID, field)
        box.click()
        box.send_keys(Keys.CONTROL, "a")
        box.send_keys(value)
    d.find_element(By.ID, "bal-save").click()
    wait("the settings are saved", lambda: "save balancer settings: done" in text("message"))
    config = get("/v1/admin/balancer")
    assert (config["period_s"], config["beta"], config["enabled"]) == (3.0, 25, True)
    d.find_element(By.ID, "bal-enabled").click()
    wait("the balancer is disabled", lambda: "disable: done" in text("message"))
    assert get("/v1/admin/balancer")["enabled"] is False
    time.sleep(2.3)  # a periodic refresh later the page still shows it disabled, period 3
    assert not d.find_element(By.ID, "bal-enabled").is_selected()
    assert d.find_element(By.ID, "bal-period").get_attribute("value") == "3"

    # --- round now (the coordinator runs a manual round even while disabled)
    d.find_element(By.ID, "round-now").click()
    wait("the manual round is reported", lambda: text("message").startswith("round "))
    assert "failed" not in text("message")
    wait("the manual round is in the table", lambda: "manual" in text("rounds"))

    # --- click a partition and move it to the other worker
    features = get("/v1/admin/partitions")["features"]
    victim = features[0]
    pid, owner = victim["id"], victim["properties"]["worker"]
    other = next(w for w in ("w0", "w1") if w != owner)
    click_partition(pid)

    def move_to() -> str | None:
        """The worker the move form proposes (None while the page redraws the form: its
        periodic refresh replaces the select between finding it and reading it)."""
        try:
            return str(Select(d.find_element(By.ID, "move-to")).first_selected_option.text)
        except StaleElementReferenceException:
            return None

    wait("the move form proposes the other worker", lambda: move_to() == other)
    shot("03-selected")
    d.find_element(By.ID, "move-go").click()
    wait("the move is reported", lambda: "moved" in text("message") or "failed" in text("message"))
    assert "failed" not in text("message"), text("message")
    after = get("/v1/admin/cluster")
    assert after["plan_version"] > plan["plan_version"]
    moved = next(f for f in get("/v1/admin/partitions")["features"]
                 if f["properties"]["parent"] == pid)
    assert moved["properties"]["worker"] == other
    assert moved["id"] in next(w for w in after["workers"] if w["id"] == other)["partitions"]
    assert not any(pid in w["partitions"] for w in after["workers"])
    # the selection follows the moved partition
    wait("the selection follows the move", lambda: f"partition\n{moved['id']}\n"
         in text("sel-props") + "\n")
    shot("04-moved")

    # --- split it along x at the proposed cell
    new_pid = moved["id"]
    props = moved["properties"]
    at = int(d.find_element(By.ID, "split-at").get_attribute("value"))
    assert props["x0"] <= at < props["x1"]
    d.find_element(By.ID, "split-go").click()
    wait("the split is reported", lambda: "split " + new_pid in text("message")
         and "…" not in text("message"))
    assert "failed" not in text("message"), text("message")
    halves = sorted((f for f in get("/v1/admin/partitions")["features"]
                     if f["properties"]["parent"] == new_pid), key=lambda f: f["properties"]["x0"])
    assert [(h["properties"]["x0"], h["properties"]["x1"]) for h in halves] == \
        [(props["x0"], at), (at + 1, props["x1"])]
    owned = sum(f["properties"]["worker"] == other
                for f in get("/v1/admin/partitions")["features"])
    wait("the map shows the halves", lambda: f"{other} ({owned})" in text("legend"))
    # the selection follows to the low half, outlined in near-black on the map
    low = halves[0]
    wait("the low half is selected", lambda: f"partition\n{low['id']}\n" in text("sel-props"))
    a, b, c, e = low["bbox"]
    edge_x, mid_y = map_point(a, (b + e) / 2)
    wait("the selected partition is outlined",  # 3 px of near-black across its left edge
         lambda: any(p[3] == 255 and max(p[:3]) < 60
                     for p in pixels(edge_x - 1, mid_y, 4, 1)))
    # an out-of-range cell is refused in the page, before any request
    at_box = d.find_element(By.ID, "split-at")
    at_box.clear()
    at_box.send_keys("100000")
    d.find_element(By.ID, "split-go").click()
    wait("an out-of-range split is refused", lambda: "must be a whole cell" in text("message"))
    shot("05-split")

    # --- the balancer back on; forget the key
    d.find_element(By.ID, "bal-enabled").click()
    wait("the balancer is enabled", lambda: "enable: done" in text("message"))
    assert get("/v1/admin/balancer")["enabled"] is True
    d.find_element(By.ID, "key-forget").click()
    wait("the view is cleared", lambda: text("workers") == "–" and text("plan-version") == "–")

    # --- the console: no JavaScript error, no failed load but the refused keys' 401/403
    logs.extend(d.get_log("browser"))
    bad = [e for e in logs if e["level"] in ("SEVERE", "WARNING")
           and not (e.get("source") == "network" and "/v1/admin/" in e["message"]
                    and (" 401 " in e["message"] or " 403 " in e["message"]))]
    assert not bad, bad
