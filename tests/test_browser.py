"""Rendered study pages opened in headless Chromium and used as a reader uses them: a click on each
number, each page in the frame `snakemake --report` shows it in. Pages are rendered from committed
evidence runs (their JSON files are kept beside their tables), so no workflow runs here; the report's
own front page is checked on the workflow's run (test_workflow). Skipped where Chromium is not
installed; CI installs it (.ci/run)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest

from quantstudy import artifacts, render, render_page
from quantstudy.devtools import Browser

from helpers import ROOT

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(not CHROMIUM, reason="no headless Chromium (apt-get install chromium)")

# Two evidence runs with their files kept: FNet (small), GPT-Neo and Deformable DETR at real size (the largest).
EVIDENCE = {
    "fnet": ROOT / "results/h200-torch-repeats/results/fnet",
    "gpt_neo": ROOT / "results/h200-gpt-neo/gpt_neo/results/gpt_neo",
    "deformable_detr": ROOT / "results/h200-deformable-detr/run-2026-12-05/results/deformable_detr",
}
NUMBER = re.compile(r"[-+]?\d[\d,]*(\.\d+)?(e[-+]?\d+)?%?x?|failed")  # a number's text, or a failure's


def _page(folder: Path, out: Path) -> tuple[Path, str]:
    """The evidence's README section rendered again, and its page (what the render rule writes)."""
    tables = artifacts.read_json(folder / "tables.json", "tables")
    section = render.render_section(tables, folder / "README.md")
    out.write_text(render_page.html_page(section, tables["title"], folder))
    return out, section


def _links(section: str) -> list[tuple[str, str]]:
    """(text, target) of every Markdown and HTML link of the section, in order: what the README means."""
    found = re.findall(r"(?<!!)\[([^\]]*)\]\(([^)\s]+)\)|<a href=\"([^\"]+)\">([^<]*)</a>", section)
    return [(md_text or html_text, md_target or html_target) for md_text, md_target, html_target, html_text in found]


@pytest.mark.parametrize("study", ["fnet", "gpt_neo"])
def test_every_number_link_opens_its_json(study, tmp_path):
    """Each number that links its JSON, clicked where it is drawn, shows that file's JSON on the screen,
    in the same page (a browser refuses to open a data: link from a page, so a number linked to one
    opens nothing)."""
    folder = EVIDENCE[study]
    page, section = _page(folder, tmp_path / "README.html")
    meant = _links(section)
    numbers = [(i, text, target) for i, (text, target) in enumerate(meant)
               if NUMBER.fullmatch(text.strip("`")) and target.endswith(".json")]
    assert len(numbers) >= 20, numbers
    with Browser(CHROMIUM) as browser:
        browser.open(page.as_uri())
        hrefs = browser.js("[...document.querySelectorAll('a[href]')].map(a => a.getAttribute('href'))")
        assert len(hrefs) == len(meant), "the page's links are not the README's"
        for i, text, target in numbers:
            # a number inside a fold: the reader opens the fold first
            x, y = browser.js(f"""(() => {{ const a = document.querySelectorAll('a[href]')[{i}];
                for (let d = a.closest('details'); d; d = d.parentElement.closest('details')) d.open = true;
                a.scrollIntoView({{block: 'center'}}); const r = a.getBoundingClientRect();
                return [r.x + r.width / 2, r.y + r.height / 2]; }})()""")
            browser.click(x, y)
            shown = browser.js("""(() => { const el = document.getElementById(decodeURIComponent(location.hash.slice(1)));
                if (!el) return null; const r = el.getBoundingClientRect();
                return {top: r.top, height: r.height, text: el.textContent, page: document.title}; })()""")
            assert shown is not None, f"{text} ({target}): the click opened nothing (href {hrefs[i][:60]})"
            assert 0 <= shown["top"] < browser.height and shown["height"] > 0, f"{text}: its JSON is not on the screen"
            assert json.loads(shown["text"]) == json.loads((folder / target).read_text()), f"{text}: not {target}"


@pytest.mark.parametrize("study", sorted(EVIDENCE))
def test_each_page_renders_in_the_reports_frame(study, tmp_path):
    """`snakemake --report` shows a README page in an iframe whose address is the page as a data: URI
    (snakemake's own data_uri_from_file). Chromium leaves a frame blank past its 2 MiB address limit:
    each page, the largest real-size studies' included, shows its verdict and plot in that frame."""
    from snakemake.report.common import data_uri_from_file

    page, _ = _page(EVIDENCE[study], tmp_path / "README.html")
    host = tmp_path / "report.html"
    host.write_text(f'<!DOCTYPE html><iframe src="{data_uri_from_file(page)}" style="width:1380px;height:980px">'
                    "</iframe>")
    with Browser(CHROMIUM) as browser:
        browser.open(host.as_uri())
        [frame] = browser.frames()
        shown = browser.js("""({heading: (document.querySelector('h2') || {}).textContent || null,
                               plot: [...document.images].some(i => i.complete && i.naturalWidth > 500)})""",
                           frame=frame["id"])
    assert shown["heading"] and shown["heading"].startswith("FP8 quantization study:"), shown
    assert shown["plot"], "the plot did not load in the frame"
