"""README sections from a study's tables.json and the Jinja templates: the section, its splice into
an existing README, the render rule's files, the report's front page and the command.

Reads JSON and templates only (no torch, no backend). Every number in the output comes from
tables.json. The parts live apart: how numbers print (render_formats), a decision's conditions in
words (render_verdict), what the templates show (render_view) and the HTML page (render_page).
The section sits between marker comments, so it can be spliced into an existing README.

    python -m quantstudy.render results/<study>/tables.json --into path/to/<study>/README.md
"""

from __future__ import annotations

import argparse
import functools
import os
import re
from pathlib import Path
from typing import Any

import jinja2

from quantstudy import paths
from quantstudy.artifacts import DamagedArtifact, atomic_write, read_json
from quantstudy.render_formats import cell_text, count, like, mib, ms, num, params_text, pct, pct0, pct_of, sci, span, times
from quantstudy.render_page import html_page
from quantstudy.render_verdict import verdict
from quantstudy.render_view import link, ran_on, setting_words, shape_label, view

TEMPLATES = Path(__file__).resolve().parent.parent / "templates"


def begin_marker(study: str) -> str:
    return f"<!-- quantstudy:begin {study} -->"


def end_marker(study: str) -> str:
    return f"<!-- quantstudy:end {study} -->"


def environment() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(TEMPLATES), undefined=jinja2.StrictUndefined,
                             trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
    formats = dict(ms=ms, times=times, pct=pct, pct_of=pct_of, pct0=pct0, mib=mib, sci=sci, num=num, count=count,
                   like=like)
    env.filters.update(span=span, cell_text=cell_text, **formats)
    env.globals.update(shape_label=shape_label, setting_words=setting_words, params_text=params_text,
                       pct_for=lambda n: functools.partial(pct_of, n=n), **formats)  # so macros can take a format as an argument
    return env


DOCS = "docs/reading-a-study.md"  # the explanations every study README shares, in the repository


def repository_of(readme: Path) -> Path:
    """The workflow root a README lives in: the nearest folder above it with a Snakefile."""
    for folder in readme.resolve().parents:
        if (folder / "Snakefile").exists():
            return folder
    raise ValueError(f"{readme} is not inside a workflow checkout (no Snakefile above it)")


def _read_kept(folder: Path, study: str, source: str) -> dict[str, Any] | None:
    """The doc of a file the tables name, where it is kept beside the README; None where it is not."""
    try:
        return read_json(folder / link(study, source))
    except (OSError, DamagedArtifact):
        return None


def render_section(tables: dict[str, Any], readme: str | Path | None = None) -> str:
    """The study's README section, markers included. `readme`: where it is written (default
    results/<study>/README.md of this checkout, every file beside it), for the links to the
    repository's docs and to the files beside it."""
    if readme is None:
        repo, kept, read = "../..", lambda source: True, None
    else:  # an evidence folder may not have kept every file its tables name: those are named, not linked
        folder = Path(readme).resolve().parent
        repo = Path(os.path.relpath(repository_of(Path(readme)), folder)).as_posix()
        kept = lambda source: (folder / link(tables["study"], source)).exists()  # noqa: E731
        read = functools.partial(_read_kept, folder, tables["study"])
    env = environment()
    body = env.get_template(f"{tables['family']}.md.j2").render(**view(tables, f"{repo}/{DOCS}", repo, kept, read))
    body = re.sub(r"\n{3,}", "\n\n", body).strip() + "\n"
    return f"{begin_marker(tables['study'])}\n{body}{end_marker(tables['study'])}\n"


def splice(existing: str, section: str, study: str) -> str:
    """Replace the study's marked section of an existing README (or append it), leaving the rest as is."""
    begin, end = begin_marker(study), end_marker(study)
    if begin in existing and end in existing:
        head, rest = existing.split(begin, 1)
        _, tail = rest.split(end, 1)
        return head + section.rstrip("\n") + tail
    return existing.rstrip("\n") + "\n\n" + section


def render_file(tables_json: str | Path, out: str | Path, into: str | Path | None = None,
                page: str | Path | None = None) -> None:
    """The README section to `out` (and spliced `into` another README); with `page`, also as one
    self-contained HTML page, the plot and every file the section links inline (html_page)."""
    tables = read_json(tables_json, "tables")
    section = render_section(tables, out)
    atomic_write(out, section)
    if page:  # the plot is an input of the render rule: it is beside the README when the page is made
        atomic_write(page, html_page(section, tables["title"], Path(out).parent))
    if into:
        into = Path(into)
        atomic_write(into, splice(into.read_text() if into.exists() else "", section, tables["study"]))


def _rst(text: str) -> str:
    """Plain text inside reStructuredText: its inline markup characters escaped."""
    return re.sub(r"([\\`*_|])", r"\\\1", str(text))


def run_kind(run: dict[str, Any], devices_text: str = "") -> str:
    """What kind of run the numbers come from, in a line: its name, its weights, the devices its jobs
    record (`devices_text`) and its note."""
    weights = "the real checkpoints" if run["weights"] == "checkpoint" else f"{run['weights']} weights"
    on = f", on {devices_text}" if devices_text else ""
    return f"Run {run['name']} ({weights}{on}). {run.get('note') or ''}".strip()


def front_page(tables_jsons: list[str | Path], out: str | Path) -> None:
    """The decisions of every study as reStructuredText, for the front page of `snakemake --report`
    (report/workflow.rst includes it): first the kind of run they come from (a smoke run on tiny
    random-init models decides nothing about the real checkpoints), then one line per study: its
    decision and the conditions it does not meet. Each condition's full verdict is its README's."""
    docs = [read_json(path, "tables") for path in tables_jsons]
    # The devices by name only: one line for a run whose studies ran on the same devices.
    kinds = list(dict.fromkeys(run_kind(t["run"], ", ".join(sorted({d["device"] for d in ran_on(t)["devices"] or []})))
                               for t in docs))
    lines = [f"**{_rst(kind)}**" for kind in kinds] + [""]
    for t in docs:
        d, verdicts = t["decision"], verdict(t)
        missed = [v for v in verdicts if not v["met"]]
        line = f"- **{_rst(t['title'])}: {'ship' if d['ship'] else 'do not ship'} {_rst(d['candidate'])}**"
        if missed:
            line += f" ({len(missed)} of {len(verdicts)} conditions not met: " + "; ".join(
                f"{_rst(v['name'])}, {_rst(v['observed'])}, needs {_rst(v['threshold'].replace('`', ''))}"
                for v in missed) + ")"
        else:
            line += f" (all {len(verdicts)} conditions met)"
        lines.append(line)
    atomic_write(out, "\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description="Render a study's README section from its tables.json.")
    parser.add_argument("tables", help="results/<study>/tables.json")
    parser.add_argument("--out", help="where to write the section (default: beside tables.json)")
    parser.add_argument("--into", help="an existing README to splice the section into, between markers")
    args = parser.parse_args()
    render_file(args.tables, args.out or paths.beside(args.tables, paths.README), args.into)


if __name__ == "__main__":
    main()
