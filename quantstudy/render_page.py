"""A README section as one self-contained HTML page (what `snakemake --report` shows): the plot
inlined, every file it links carried once at the end in a fold with an id.
"""

from __future__ import annotations

import base64
import html
import os
import re
from pathlib import Path

PAGE_STYLE = ("body{font-family:sans-serif;max-width:80em;margin:1em auto;padding:0 1em;line-height:1.4}"
              "table{border-collapse:collapse;margin:.5em 0;font-size:90%}th,td{border:1px solid #ccc;padding:2px 6px}"
              "th{background:#f3f3f3}img{max-width:100%}code{background:#f6f6f6}"
              "details.file{margin:.3em 0}details.file pre{background:#f6f6f6;padding:.5em;overflow:auto;max-height:40em}"
              "details.file>:not(summary){scroll-margin-top:2.5em}"
              ":target{outline:3px solid #ff7f0e}")


LINK = re.compile(r'(href|src)="([^"#:]+)(#[^"]*)?"')
MEDIA = {".png": "image/png", ".svg": "image/svg+xml", ".jpg": "image/jpeg"}


def anchor_id(path: str) -> str:
    """A fragment id for a file the page carries, from its path: `file-cpu-torch-<model>-w512-fp8-timing-json`."""
    parts = [p for p in Path(os.path.normpath(path)).parts if p not in ("..", ".")]
    return "file-" + re.sub(r"[^a-z0-9]+", "-", "/".join(parts).lower()).strip("-")


def _heading_ids(body: str, prefix: str) -> str:
    """GitHub's heading anchors (`## The plot` -> `the-plot`) on the headings of a rendered Markdown
    file, prefixed by the file's id, so a link to `reading-a-study.md#the-plot` lands on its heading."""
    def slug(match: re.Match) -> str:
        text = re.sub(r"<[^>]+>", "", match.group(2))
        s = re.sub(r"[^\w\- ]", "", html.unescape(text).strip().lower()).replace(" ", "-")
        return f'<h{match.group(1)} id="{prefix}--{s}">{match.group(2)}</h{match.group(1)}>'
    return re.sub(r"<h([1-6])>(.*?)</h\1>", slug, body)


def _markdown(text: str) -> str:
    from markdown_it import MarkdownIt

    return MarkdownIt("commonmark", {"html": True}).enable("table").render(text)  # the folds are HTML


def html_page(section: str, title: str, folder: str | Path | None = None) -> str:
    """The section as one self-contained HTML page: what `snakemake --report` shows. An image resolved
    from `folder` (the README's) is inlined as a data URI; every other file a link resolves to is carried
    once, at the end of the page, in a closed fold with an id (its JSON as text, a Markdown page
    rendered), and the link points at that id: a click opens the fold and scrolls to it, offline, in the
    report's frame as in a browser tab (a browser does not navigate a page to a data: link). A link to no
    file stays as is."""
    markdown = "\n".join(line for line in section.splitlines() if not line.startswith("<!-- quantstudy:"))
    body = _markdown(markdown)
    folder = Path(folder) if folder is not None else None
    carried: dict[str, str] = {}  # link target -> the fold's id
    images: dict[str, str] = {}

    def inline(match: re.Match) -> str:
        attr, target, fragment = match.group(1), match.group(2), match.group(3) or ""
        path = (folder or Path(".")) / target
        if folder is None or not path.is_file():
            return match.group(0)
        if attr == "src" and path.suffix in MEDIA:
            if target not in images:
                images[target] = f"data:{MEDIA[path.suffix]};base64,{base64.b64encode(path.read_bytes()).decode()}"
            return f'src="{images[target]}"'
        fold = carried.setdefault(target, anchor_id(target))
        if fragment and path.suffix == ".md":
            return f'href="#{fold}--{fragment[1:]}" title="{html.escape(target + fragment)}"'
        return f'href="#{fold}" title="{html.escape(target)}"'

    body = LINK.sub(inline, body)
    folds = []
    for target, fold in carried.items():
        path = folder / target
        if path.suffix in MEDIA:
            data = base64.b64encode(path.read_bytes()).decode()
            content = f'<img id="{fold}" src="data:{MEDIA[path.suffix]};base64,{data}" alt="{html.escape(target)}">'
        elif path.suffix == ".md":
            content = f'<div id="{fold}">{_heading_ids(_markdown(path.read_text()), fold)}</div>'
        else:
            content = f'<pre id="{fold}">{html.escape(path.read_text(errors="replace"), quote=False)}</pre>'
        folds.append(f'<details class="file"><summary><code>{html.escape(target)}</code> '
                     f"({path.stat().st_size / 1024:,.1f} KiB)</summary>\n{content}\n</details>")
    if folds:
        body += ('<h3 id="files">The files this page links</h3>\n<p>Each link above opens its file here.</p>\n'
                 + "\n".join(folds) + "\n")
    return (f'<!DOCTYPE html>\n<html><head><meta charset="utf-8"><title>{html.escape(title)}</title>'
            f"<style>{PAGE_STYLE}</style></head>\n<body>\n{body}</body></html>\n")
