"""scripts/check_site.py, the docs site's browser check: what it reports from what a page holds, and
(where Chromium and its driver are installed) what it finds in a real browser."""

from __future__ import annotations

import shutil

import pytest
from repo_scripts import load_script

check_site = load_script("scripts/check_site.py", "check_site")
BASE = "http://127.0.0.1:8000/spmdcall/"
DEPLOYED = "https://spmdcall.github.io/spmdcall/"


def _page(links=(), ids=(), failed_images=(), tables=()) -> check_site.Page:
    return check_site.Page(
        ids=set(ids),
        links=list(links),
        num_images=len(failed_images),
        failed_images=list(failed_images),
        tables=list(tables),
    )


def test_check_reports_broken_links_anchors_images_and_wide_tables(tmp_path):
    (tmp_path / "index.html").write_text("")
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "index.html").write_text("")
    (tmp_path / "chart.png").write_bytes(b"")
    pages = {
        "index.html": _page(
            links=[
                BASE + "data/#install",  # fine
                DEPLOYED + "data/#install",  # the deployed site's address: inside the site too
                BASE + "data/#nowhere",
                BASE + "gone/",
                BASE + "chart.png",  # fine
                "http://127.0.0.1:8000/elsewhere/",
                "https://example.org/#anything",  # another site: counted, not fetched
            ],
            failed_images=["missing.png"],
            tables=[
                {"heading": "a | b", "width": 900, "room": 704},
                {"heading": "c", "width": 705, "room": 704},
            ],
        ),
        "data/index.html": _page(ids=["install"]),
    }
    report = check_site.check(tmp_path, pages, (BASE, DEPLOYED))
    assert report.problems == [
        "index.html: image missing.png does not load",
        "index.html: table [a | b] is 900 px wide, 704 px of it show (at a 1280 px window)",
        "index.html: link to data/index.html#nowhere: no such anchor",
        "index.html: link to gone/: no such page or file",
        "index.html: link to /elsewhere/: outside the site",
    ]
    assert (report.num_links, report.num_anchors, report.num_external) == (5, 3, 1)


@pytest.mark.timeout(120)
@pytest.mark.skipif(
    not (shutil.which("chromium") and shutil.which("chromedriver")),
    reason="needs chromium and chromedriver (apt-get install chromium chromium-driver)",
)
def test_the_browser_finds_what_a_reader_would(tmp_path, capsys):
    pytest.importorskip("selenium", reason="selenium is in the docs extra")
    (tmp_path / "index.html").write_text(
        '<html><body><h1 id="top">Home</h1><a href="page/#top">ok</a> <a href="page/#gone">anchor</a>'
        ' <a href="nowhere/">page</a> <img src="missing.png">'
        f"<table><tr><th>{'x' * 400}</th></tr></table></body></html>"
    )
    (tmp_path / "page").mkdir()
    (tmp_path / "page" / "index.html").write_text('<html><body><h1 id="top">Page</h1></body></html>')
    assert check_site.main([str(tmp_path)]) == 1
    problems = [line for line in capsys.readouterr().out.splitlines() if line.startswith("index.html: ")]
    assert len(problems) == 4, problems
    assert "image missing.png does not load" in problems[0]
    assert "px of it show" in problems[1]
    assert problems[2:] == [
        "index.html: link to page/index.html#gone: no such anchor",
        "index.html: link to nowhere/: no such page or file",
    ]
