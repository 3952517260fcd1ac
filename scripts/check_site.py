"""Open every page of the built docs site in headless Chromium and fail on what a reader would trip on.

    make docs-check                           build the site (strict), then check it
    python scripts/check_site.py [SITE_DIR]   check a site already built (default: build/site)

The site is served from a local HTTP server under the path of mkdocs.yml's ``site_url``, as it
will be deployed, and each page is loaded in a 1280x900 browser window. Reported, one line each:

- a link to a page or file of the site that does not exist, or to an ``#anchor`` that its page
  does not have (links to other hosts are counted, not fetched: the check runs offline);
- an image of the site that does not load;
- a table wider than the content column. Material puts each table in a box that scrolls
  sideways, so a wide table still fits the page, but a reader must scroll to see its right-hand
  columns: that is what this reports.

Exits 1 when it found a problem, 2 when it cannot run. Needs Chromium and its driver (Debian:
``apt-get install chromium chromium-driver``) and ``selenium`` (the docs extra).
"""

from __future__ import annotations

import argparse
import functools
import http.server
import importlib.util
import shutil
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import unquote, urljoin, urlsplit

import yaml

ROOT = Path(__file__).resolve().parents[1]
WINDOW = (1280, 900)
CHROMIUM_FLAGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-dev-shm-usage",  # containers often have a small /dev/shm
]
PAGE_TIMEOUT_S = 30

# Run in the page once it has loaded: its ids, its links as the browser resolved them, the images
# that do not decode, and each table's width beside the width it has to fit in.
INSPECT_PAGE = """
const done = arguments[arguments.length - 1];
const images = Array.from(document.images).filter(img => img.src);
const failed = Promise.all(images.map(img => {
    img.loading = "eager";
    return img.decode().then(() => null, () => img.getAttribute("src"));
}));
failed.then(failed => {
    const column = document.querySelector("article.md-content__inner") || document.body;
    const tables = Array.from(column.querySelectorAll("table")).map(table => {
        // Material puts a table in a wrapper that scrolls sideways (and the table scrolls inside
        // itself past the column's width): what lies outside the wrapper's box is hidden until the
        // reader scrolls. A few pixels of the wrapper's own padding out of sight hide nothing.
        const wrap = (table.closest(".md-typeset__scrollwrap") || column).getBoundingClientRect();
        const box = table.getBoundingClientRect();
        const header = Array.from(table.querySelectorAll("th")).map(th => th.textContent.trim());
        return {
            heading: header.slice(0, 3).join(" | ").slice(0, 80),
            // Widths with the table's borders: its content and borders, beside what shows of it.
            width: table.scrollWidth + table.offsetWidth - table.clientWidth,
            room: Math.round(Math.min(table.offsetWidth, wrap.right - box.left)),
        };
    });
    done({
        ids: Array.from(document.querySelectorAll("[id], a[name]")).map(el => el.id || el.name),
        links: Array.from(document.querySelectorAll("a[href]")).map(a => a.href),
        images: images.length,
        failed: failed.filter(src => src !== null),
        tables: tables,
    });
});
"""


@dataclass
class Page:
    """What the browser found on one page."""

    ids: set[str]
    links: list[str]
    num_images: int
    failed_images: list[str]
    tables: list[dict]


@dataclass
class Report:
    problems: list[str] = field(default_factory=list)
    num_links: int = 0
    num_anchors: int = 0
    num_external: int = 0


class _Handler(http.server.SimpleHTTPRequestHandler):
    """Serves the site's files under ``prefix`` only, as a host serves the deployed site."""

    def __init__(self, *args, prefix: str, **kwargs):
        self.prefix = prefix
        super().__init__(*args, **kwargs)

    def translate_path(self, path: str) -> str:
        path = urlsplit(path).path
        if not path.startswith(self.prefix):
            return str(Path(self.directory) / "does-not-exist")
        return super().translate_path("/" + path[len(self.prefix) :])

    def log_message(self, *args):
        pass  # a line per request would bury the report


def serve(site: Path, prefix: str) -> http.server.ThreadingHTTPServer:
    """A server on a free port of 127.0.0.1, serving in a daemon thread."""
    handler = functools.partial(_Handler, directory=str(site), prefix=prefix)
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def open_browser(profile: Path):
    """Headless Chromium driven through the system's chromedriver, with a fresh profile."""
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for flag in [*CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--window-size={},{}".format(*WINDOW)]:
        options.add_argument(flag)
    options.binary_location = shutil.which("chromium") or ""
    driver = webdriver.Chrome(options=options, service=Service(shutil.which("chromedriver")))
    driver.set_page_load_timeout(PAGE_TIMEOUT_S)
    driver.set_script_timeout(PAGE_TIMEOUT_S)
    return driver


def inspect_pages(driver, base: str, names: list[str]) -> dict[str, Page]:
    pages = {}
    for name in names:
        driver.get(urljoin(base, name))
        found = driver.execute_async_script(INSPECT_PAGE)
        pages[name] = Page(
            ids=set(found["ids"]),
            links=found["links"],
            num_images=found["images"],
            failed_images=found["failed"],
            tables=found["tables"],
        )
    return pages


def site_path(url: str, bases: tuple[str, ...]) -> str | None:
    """The path of ``url`` inside the site (``""`` for its home page), or None for another site."""
    for base in bases:
        if url.startswith(base):
            return unquote(urlsplit(url[len(base) :]).path)
    return None


def target_file(site: Path, path: str) -> str | None:
    """The file a path of the site serves, relative to the site, or None when there is none."""
    candidate = site / path
    if candidate.is_dir():
        candidate = candidate / "index.html"
    return candidate.relative_to(site).as_posix() if candidate.is_file() else None


def check(site: Path, pages: dict[str, Page], bases: tuple[str, ...]) -> Report:
    """The problems of ``pages`` (by their paths in ``site``), whose links to the site start with
    one of ``bases``: the first one, the local server's, is where the pages were opened."""
    report = Report()
    origin = "{0.scheme}://{0.netloc}/".format(urlsplit(bases[0]))
    for name, page in pages.items():
        for src in page.failed_images:
            report.problems.append(f"{name}: image {src} does not load")
        for table in page.tables:
            if table["width"] > table["room"] + 1:
                report.problems.append(
                    f"{name}: table [{table['heading']}] is {table['width']} px wide, {table['room']} px "
                    f"of it show (at a {WINDOW[0]} px window)"
                )
        for url in page.links:
            path = site_path(url, bases)
            if path is None and url.startswith(origin):
                report.problems.append(f"{name}: link to {urlsplit(url).path}: outside the site")
                continue
            if path is None:
                report.num_external += urlsplit(url).scheme in ("http", "https", "mailto")
                continue
            report.num_links += 1
            target = target_file(site, path)
            fragment = unquote(urlsplit(url).fragment)
            if target is None:
                report.problems.append(f"{name}: link to {path or '/'}: no such page or file")
            elif fragment and target in pages:
                report.num_anchors += 1
                if fragment not in pages[target].ids:
                    report.problems.append(f"{name}: link to {target}#{fragment}: no such anchor")
            elif fragment:
                report.problems.append(f"{name}: link to {target}#{fragment}: an anchor into a file")
    return report


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("site", nargs="?", type=Path, default=ROOT / "build" / "site")
    args = parser.parse_args(argv)
    site = args.site.resolve()
    if not (site / "index.html").is_file():
        print(f"check_site: no built site in {site} (run: make docs)", file=sys.stderr)
        return 2
    missing = [tool for tool in ("chromium", "chromedriver") if shutil.which(tool) is None]
    if missing:
        print(
            f"check_site: no {' or '.join(missing)} (apt-get install chromium chromium-driver)",
            file=sys.stderr,
        )
        return 2
    if importlib.util.find_spec("selenium") is None:
        print('check_site: selenium is not installed (pip install -e ".[docs]")', file=sys.stderr)
        return 2

    site_url = yaml.safe_load((ROOT / "mkdocs.yml").read_text())["site_url"]
    prefix = urlsplit(site_url).path or "/"
    server = serve(site, prefix)
    local = f"http://127.0.0.1:{server.server_address[1]}{prefix}"
    names = sorted(p.relative_to(site).as_posix() for p in site.rglob("*.html"))
    with tempfile.TemporaryDirectory(prefix="check-site-") as profile:
        driver = open_browser(Path(profile))
        try:
            pages = inspect_pages(driver, local, names)
        finally:
            driver.quit()
            server.shutdown()

    # A link to the deployed site's own address is a link inside the site, too.
    report = check(site, pages, (local, site_url))
    for problem in report.problems:
        print(problem)
    num_tables = sum(len(p.tables) for p in pages.values())
    num_images = sum(p.num_images for p in pages.values())
    print(
        f"check_site: {len(pages)} pages, {report.num_links} links inside the site "
        f"({report.num_anchors} to an anchor), {report.num_external} to other sites (not fetched), "
        f"{num_images} images, {num_tables} tables at {WINDOW[0]} px: {len(report.problems)} problems"
    )
    return 1 if report.problems else 0


if __name__ == "__main__":
    sys.exit(main())
