"""The documentation site builds with no warning, its pages link only to what exists, and a
browser shows the course's figures.

The site is built once for this module, as ``make docs`` builds it (``sphinx-build -W
--keep-going``, offline), into a temporary folder. Links are checked in the built HTML: every
relative ``href``/``src`` must name a file of the site and, with ``#anchor``, an ``id`` on
that page (Sphinx's ``linkcheck`` builder checks the web too, which CI cannot reach). The
course pages are opened in headless Chromium (Debian's ``chromium`` and ``chromium-driver``,
which ``make test`` installs) through Selenium, and every image must have loaded
(``complete`` and ``naturalWidth > 0``, the browser's own test of a decoded image).
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from lightning_par.launch.processes import run_bounded

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
NOTEBOOKS = sorted(p.stem for p in (ROOT / "course").glob("[0-9][0-9]_*.ipynb"))
CHROMIUM = "/usr/bin/chromium"
CHROMEDRIVER = "/usr/bin/chromedriver"


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("site")
    cmd = [sys.executable, "-m", "sphinx", "-q", "-W", "--keep-going", "-b", "html", str(DOCS)]
    proc = run_bounded([*cmd, str(out)], 600, cwd=ROOT)
    assert proc.returncode == 0, f"the docs build warned or failed:\n{proc.stderr[-6000:]}"
    assert proc.stderr.strip() == "", proc.stderr[-6000:]
    return out


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.links: list[str] = []
        self.ids: set[str] = set()

    def handle_starttag(self, tag, attrs) -> None:
        for name, value in attrs:
            if name == "id" and value:
                self.ids.add(value)
            elif name in ("href", "src") and value:
                self.links.append(value)


def _parse(page: Path) -> _Links:
    parser = _Links()
    parser.feed(page.read_text(encoding="utf-8"))
    return parser


def test_the_site_has_every_section_and_every_notebook(site):
    for page in ("index", "guide/install", "guide/own-model", "guide/launching",
                 "guide/troubleshooting", "guide/features", "strategies/gpipe",
                 "reference/api", "reference/compare", "benchmarks/compare/report"):  # fmt: skip
        assert (site / f"{page}.html").is_file(), page
    for name in NOTEBOOKS:
        assert (site / "course" / f"{name}.html").is_file(), name
    # the feature table is generated from lightning_par.features at build time
    from lightning_par.features import FEATURES, ROWS

    text = (site / "guide" / "features.html").read_text()
    for key in [*ROWS, *FEATURES]:
        assert f'<code class="docutils literal notranslate"><span class="pre">{key}' in text


def test_every_internal_link_resolves(site):
    broken, parsed = [], {}
    pages = sorted(site.rglob("*.html"))
    assert len(pages) > 40
    for page in pages:
        for link in _parse(page).links:
            parts = urlsplit(link)
            if parts.scheme or link.startswith("//") or link.startswith("mailto:"):
                continue
            target = (page.parent / unquote(parts.path)).resolve() if parts.path else page
            if target.is_dir():
                target = target / "index.html"
            if not target.exists():
                broken.append(f"{page.relative_to(site)}: {link}")
            elif parts.fragment and target.suffix == ".html":
                if target not in parsed:
                    parsed[target] = _parse(target).ids
                if parts.fragment not in parsed[target]:
                    broken.append(f"{page.relative_to(site)}: {link} (no such anchor)")
    assert not broken, "\n".join(broken[:40])


def _browser(scratch: Path):
    """Headless Chromium whose profile and singleton socket live in ``scratch`` (by default
    both go to /tmp, where ``org.chromium.Chromium.*`` folders outlived every run)."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    for path in (CHROMIUM, CHROMEDRIVER):
        assert shutil.which(path), f"{path} is missing: `make test` installs chromium"
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
                "--allow-file-access-from-files"):  # fmt: skip
        options.add_argument(arg)
    options.add_argument(f"--user-data-dir={scratch / 'profile'}")
    service = Service(CHROMEDRIVER, env={**os.environ, "TMPDIR": str(scratch)})
    return webdriver.Chrome(service=service, options=options)


IMAGES = """
return Array.from(document.images).map(i => ({src: i.getAttribute('src'),
    complete: i.complete, width: i.naturalWidth}));
"""


def test_a_browser_shows_every_figure_of_the_course(site):
    # (a short folder of its own: Chromium's singleton socket in a test's tmp_path passes
    # the 108 bytes a Unix socket's path may have, and Chromium exits at once)
    scratch = Path(tempfile.mkdtemp(prefix="lpt-chromium-"))
    driver = _browser(scratch)
    try:
        driver.set_page_load_timeout(60)
        seen = {}
        for name in NOTEBOOKS:
            driver.get((site / "course" / f"{name}.html").as_uri())
            assert "lightning_par" in driver.title, (name, driver.title)
            seen[name] = driver.execute_script(IMAGES)
    finally:
        driver.quit()
        shutil.rmtree(scratch, ignore_errors=True)
    figures = {name: [i for i in images if "_images/" in i["src"]] for name, images in seen.items()}
    assert sum(len(f) for f in figures.values()) >= len(NOTEBOOKS), json.dumps(seen)[:3000]
    assert all(figures.values()), {n: len(f) for n, f in figures.items()}
    broken = [(n, i) for n, images in seen.items() for i in images if not i["width"]]
    broken += [(n, i) for n, images in seen.items() for i in images if not i["complete"]]
    assert not broken, broken[:10]
