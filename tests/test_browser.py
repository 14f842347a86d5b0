"""The report pages in a real headless browser (Debian's chromium through Selenium): each loads
from file:// with no console error and no network request, its SVG plots render (a screenshot
that is not blank, every plot drawn with a size), and a failing report shows the failure first.
Without chromium the tests skip locally but FAIL under CI (a skipped assertion is a defect)."""

import os
import shutil
from io import BytesIO
from pathlib import Path

import pytest

from tests.ranks import spawn
from tests.report_nights import shared

SHOTS = os.environ.get("FSDP_VERIFY_SCREENSHOTS")  # a folder to keep the screenshots in


@pytest.fixture(scope="module")
def browser():
    chromium = shutil.which("chromium") or shutil.which("chromium-browser") or shutil.which("google-chrome")
    driver_path = shutil.which("chromedriver")
    if not (chromium and driver_path):
        message = "chromium and chromedriver are needed (apt-get install -y chromium chromium-driver)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in (
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--window-size=1280,1600",
    ):
        options.add_argument(arg)
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


@pytest.fixture(scope="module")
def reports(tmp_path_factory) -> Path:
    return shared(tmp_path_factory)


def open_page(driver, path: Path) -> dict:
    """Load a page; what the browser says about it."""
    driver.get_log("browser")  # drop what an earlier page logged
    driver.get(path.resolve().as_uri())
    return {
        "errors": [e for e in driver.get_log("browser") if e["level"] == "SEVERE"],
        "requests": driver.execute_script(
            "return performance.getEntriesByType('resource').map(e => e.name)"
            ".concat(performance.getEntriesByType('navigation').length === 1 ? [] : ['navigation?'])"
        ),
        "plots": driver.execute_script(
            "return [...document.querySelectorAll('svg.plot')].map(s => {const r = s.getBoundingClientRect();"
            " return {name: s.dataset.plot, top: r.top + window.scrollY, width: r.width, height: r.height,"
            " shapes: s.querySelectorAll('rect.bar, polyline, circle, rect.cell').length}})"
        ),
    }


def shot(driver, name: str):
    from PIL import Image

    png = driver.get_screenshot_as_png()
    if SHOTS:
        Path(SHOTS).mkdir(parents=True, exist_ok=True)
        Path(SHOTS, f"{name}.png").write_bytes(png)
    return Image.open(BytesIO(png)).convert("RGB")


def not_blank(image) -> bool:
    colours = image.getcolors(maxcolors=1 << 16)
    return colours is None or len(colours) > 8  # None: more colours than that


PAGES = {
    # name: (path under the shared folder, plots that must be there, failing?)
    "check-pass": ("check-ok/report.html", {"ratios", "histogram", "slowest"}, False),
    "check-fail": ("check-bad/report.html", {"ratios", "histogram", "slowest"}, True),
    "fuzz": ("fuzz/report.html", {"ratios", "histogram", "slowest"}, False),
    "sweep-pass": ("nights/2026-11-05/sweep/report.html", {"ratios", "histogram", "slowest", "zoo"}, False),
    "sweep-fail": ("nights/2026-11-04/sweep/report.html", {"ratios", "histogram", "slowest"}, True),
    "selftest": ("zoo/report.html", {"zoo"}, False),
    "trend": ("trend.html", {"trend-failures", "trend-speed", "trend-worst", "trend-p99", "trend-zoo"}, False),
}


@pytest.mark.parametrize("name", PAGES)
def test_page_loads_offline_and_draws_its_plots(browser, reports, name):
    rel, plots, failing = PAGES[name]
    seen = open_page(browser, reports / rel)
    assert seen["errors"] == [] and seen["requests"] == []
    names = {p["name"] for p in seen["plots"]}
    assert plots <= names, names
    for p in seen["plots"]:
        assert p["width"] > 100 and p["height"] > 20 and p["shapes"] > 0, p
    assert not_blank(shot(browser, name))
    failures = browser.execute_script(
        "const f = document.getElementById('failures'); if (!f) return null;"
        " const r = f.getBoundingClientRect(); return {top: r.top + window.scrollY, text: f.innerText}"
    )
    status = browser.find_element("id", "status").text
    if failing:
        assert "FAIL" in status
        assert failures is not None and "GradsComparator @ 1/grads" in failures["text"]
        assert failures["top"] < min(p["top"] for p in seen["plots"])  # before every plot
        assert failures["top"] < browser.execute_script("return window.innerHeight")  # on the first screen
    elif name != "trend":
        assert failures is None and "PASS" in status


def test_the_checks_catch_a_page_that_errs_or_fetches(browser, tmp_path):
    """The two page-level assertions above can fail: a script error and a fetched image."""
    page = tmp_path / "bad.html"
    page.write_text(
        '<!DOCTYPE html><html><body><img src="http://127.0.0.1:9/x.png"><script>nope()</script></body></html>'
    )
    seen = open_page(browser, page)
    assert any("nope" in e["message"] for e in seen["errors"])
    assert seen["requests"] == ["http://127.0.0.1:9/x.png"]
    blank = tmp_path / "blank.html"
    blank.write_text("<!DOCTYPE html><html><body></body></html>")
    open_page(browser, blank)
    assert not not_blank(shot(browser, "blank-control"))


@pytest.fixture(scope="module")
def compare_pages(tmp_path_factory) -> dict[str, Path]:
    """`fsdp-verify compare`'s page for an equivalent pair and for one whose gradient moved."""
    import torch

    from fsdp_verify.commands.cli import main
    from tests.test_recorder import Inner, train

    d = tmp_path_factory.mktemp("compare-pages")
    train(d / "ref")
    train(d / "twin")
    torch.manual_seed(0)
    bad = Inner()
    bad.lin.weight.register_hook(lambda g: g * (1 + 2e-6))
    train(d / "bad", model=bad)
    assert main(["compare", str(d / "ref"), str(d / "twin"), "--out", str(d / "pass")]) == 0
    assert main(["compare", str(d / "ref"), str(d / "bad"), "--out", str(d / "fail")]) == 1

    spawn(_train_apart, args=(str(d / "store"), str(d / "apart")), nprocs=2)
    assert main(["compare", str(d / "ref"), str(d / "apart"), "--out", str(d / "not-sharded")]) == 1
    return {
        "pass": d / "pass" / "report.html",
        "fail": d / "fail" / "report.html",
        "not-sharded": d / "not-sharded" / "report.html",
    }


def _train_apart(rank: int, store: str, out: str) -> None:
    """Two gloo ranks that each train their own copy (no FSDP, no collective): NOT SHARDED."""
    import warnings

    import torch.distributed as dist

    from tests.test_recorder import train

    dist.init_process_group("gloo", store=dist.FileStore(store, 2), rank=rank, world_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the Recorder's own warning: every parameter is plain
        train(Path(out), batch=3 + rank)  # the ranks' batches differ, so do their gradients
    dist.destroy_process_group()


@pytest.mark.parametrize("outcome", ["pass", "fail", "not-sharded"])
def test_compares_page_shows_the_runs_the_rules_and_the_steps_first(browser, compare_pages, outcome):
    """One pair of runs: none of the sweep page's widgets that mean nothing for it ("Engine None",
    cases a minute, a one-case histogram, the slowest cases); the runs, the rules used and the
    steps x phases table come first, after the divergence where there is one."""
    seen = open_page(browser, compare_pages[outcome])
    assert seen["errors"] == [] and seen["requests"] == []
    text = browser.find_element("tag name", "body").text
    for widget in ("Engine", "cases/min", "Worst ratio per case", "Slowest cases", "Comparators"):
        assert widget not in text, widget
    assert {p["name"] for p in seen["plots"]} == {"ratios"}, seen["plots"]
    assert all(p["width"] > 100 and p["height"] > 20 and p["shapes"] > 0 for p in seen["plots"])
    assert not_blank(shot(browser, f"compare-{outcome}"))
    top = {
        name: browser.execute_script(
            f"const r = document.getElementById('{name}').getBoundingClientRect(); return r.top + window.scrollY"
        )
        for name in ("status", "runs", "rules", "steps", "records")
    }
    assert top["status"] < top["runs"] < top["rules"] < top["steps"] < seen["plots"][0]["top"] < top["records"]
    assert top["runs"] < browser.execute_script("return window.innerHeight")  # on the first screen
    runs = browser.find_element("id", "runs").text
    assert "reference" in runs and "sharded" in runs and "AdamW" in runs
    assert "exact" in browser.find_element("id", "rules").text
    assert browser.find_element("id", "steps").text.startswith("step")
    status = browser.find_element("id", "status").text
    if outcome == "fail":
        assert "FAIL" in status
        failures = browser.find_element("id", "failures")
        assert "First divergence at step 1, gradients, 'lin.weight'" in failures.text
        assert failures.location["y"] < top["runs"]
    elif outcome == "not-sharded":
        assert status.endswith("NOT SHARDED") and "FAIL" not in status
        failures = browser.find_element("id", "failures")
        assert (
            failures.text.startswith("Not sharded")
            and "every one of its 4 parameters is a plain tensor" in failures.text
        )
        assert "sharding" in browser.find_element("id", "steps").text.split("\n")[0]
    else:
        assert "PASS" in status and "EQUIVALENT" in browser.find_element("id", "verdict").text


def test_a_zoomed_check_page_draws_the_module_tree_and_the_op_table(browser, tmp_path):
    """`check --zoom --out`: the module heat map (an SVG cell per module and direction, the named
    module's outlined) and the op table, with no error and no request."""
    from fsdp_verify.commands.cli import main

    args = ["check", "--model", "tests/user/models.py:buffer_cast_to_bf16", "--wrap", "UserBlock"]
    assert main(args + ["--steps", "1", "--seq-len", "6", "--zoom", "--out", str(tmp_path)]) == 1
    seen = open_page(browser, tmp_path / "report.html")
    assert seen["errors"] == [] and seen["requests"] == []
    tree = [p for p in seen["plots"] if p["name"] == "zoom-modules"]
    assert tree and tree[0]["width"] > 100 and tree[0]["shapes"] >= 2 * 5, seen["plots"]
    assert (
        browser.execute_script("return document.querySelectorAll('svg[data-plot=zoom-modules] rect[stroke]').length")
        == 1
    )
    ops = browser.find_element("id", "zoom-ops").text
    assert "aten.mul.Tensor" in ops
    assert "blocks.1" in browser.find_element("id", "zoom-chain").text
    # The chain on the first screen too, in the failure box.
    assert "forward of module 'blocks.1'" in browser.find_element("id", "failures").text
    assert not_blank(shot(browser, "check-zoom"))


def test_a_many_failure_sweep_shows_each_cause_once_with_its_tracebacks_folded(browser, reports):
    """7 failing cases of 3 causes (tests/engines/many_causes.py): the failure box says so first,
    a cause a block with its count, smallest case and replay line, every traceback folded (and
    there on a click), the whole box on the first screen."""
    seen = open_page(browser, reports / "causes-nights" / "2026-12-02" / "sweep" / "report.html")
    assert seen["errors"] == [] and seen["requests"] == []
    assert browser.find_element("id", "causes-headline").text == "7 failing cases, 3 causes"
    causes = browser.find_elements("css selector", "#failures .cause")
    assert sorted(int(c.get_attribute("data-count")) for c in causes) == [2, 2, 3]
    for cause in causes:
        assert "Smallest: " in cause.text and "Replay: fsdp-verify repro " in cause.text
        members = cause.find_element("css selector", "details.members")
        assert members.get_attribute("open") is None
        assert not members.find_element("tag name", "pre").is_displayed()
    box = browser.execute_script(
        "const r = document.getElementById('failures').getBoundingClientRect(); return r.bottom + window.scrollY"
    )
    assert box < browser.execute_script("return window.innerHeight") and box < min(p["top"] for p in seen["plots"])
    assert not_blank(shot(browser, "sweep-causes"))
    raised = next(c for c in causes if "a rank raised" in c.text)
    assert "Traceback" not in raised.text
    raised.find_element("css selector", "details.members summary").click()
    assert "Traceback (most recent call last)" in raised.find_element("css selector", "details.members pre").text
