"""How a README prints a number, a range and a recorded text: the formats the templates use as
filters, and the ranges the sentences give (computed from all rows of the table they summarize).

Plain functions of values (no tables.json, no templates): aggregate and the audit's search for a
printed number use them too.
"""

from __future__ import annotations

import html
import math


def ms(v) -> str:
    return "-" if v is None else f"{v:.3f}" if v < 100 else f"{v:.1f}"


def times(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def pct(v) -> str:
    return "-" if v is None else f"{100 * v:.2f}%"


def sci(v) -> str:
    if v is None:
        return "-"
    if v == 0:
        return "0"
    return f"{v:.2g}" if 1e-3 <= abs(v) < 1e3 else f"{v:.1e}"


def num(v, digits: int = 4) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def count(v) -> str:
    return "-" if v is None else f"{int(v):,}"


def like(v, printed: str, signed: bool = False, units: str = "") -> str:
    """`v` in the notation and precision the write-up printed a number in (0.752, 5.9e-06, 69,042);
    a percentage with at least two decimals (a printed 100% next to 99.85%)."""
    if v is None:
        return "-"
    mantissa, e, _ = printed.lower().partition("e")
    decimals = len(mantissa.partition(".")[2])
    if units == "%":
        decimals = max(decimals, 2)
    sign = "+" if signed else ""
    return f"{v:{sign}.{decimals}e}" if e else f"{v:{sign}{',' if ',' in printed else ''}.{decimals}f}"


def pct_of(v, n: int | None) -> str:
    """A fraction of `n` samples as a percentage with the precision one sample supports: 94% of 16
    images, 99.8% of 400, 99.85% of 2,000 (one sample is 6.25, 0.25 and 0.05 points)."""
    if v is None:
        return "-"
    if not n:
        return pct(v)
    decimals = min(2, max(0, math.ceil(-math.log10(100 / n))))
    return f"{100 * v:.{decimals}f}%"


def pct0(v) -> str:
    """A change in whole percent, signed: -27%."""
    return "-" if v is None else f"{100 * v:+.0f}%"


def mib(n_bytes) -> str:
    """Bytes in MiB to three significant digits (0.296, 67.7, 1,230)."""
    if n_bytes is None:
        return "-"
    v = n_bytes / 2**20
    return f"{v:,.0f}" if v >= 100 else f"{v:.3g}"


def params_text(p) -> str:
    """A transform's parameters as words, not JSON: `factor 64, when window 512`."""
    if isinstance(p, dict):
        return ", ".join(f"{k} {params_text(v)}" for k, v in p.items())
    if isinstance(p, (list, tuple)):
        return " / ".join(params_text(v) for v in p)
    return str(p)


def cell_text(text) -> str:
    """Recorded text (an error) inside a Markdown table cell: a pipe would end the cell, and a `<`
    would start HTML (the page and GitHub render the folds' HTML)."""
    return html.escape(str(text), quote=False).replace("|", "\\|")


def span(r: dict | None, fmt=times, unit: str = "") -> str:
    """'a to b' (or 'a') from a computed range: a symbol after each end (1.03x to 1.11x), a word (a unit
    starting with a space) once, after the range (48.1 to 48.7 times)."""
    if not r:
        return "not measured"
    lo, hi = fmt(r["min"]), fmt(r["max"])
    if lo == hi:
        return f"{lo}{unit}"
    return f"{lo} to {hi}{unit}" if unit.startswith(" ") else f"{lo}{unit} to {hi}{unit}"


def value_range(values) -> dict | None:
    """min, max and count of the finite values among `values` (None and NaN left out), or None."""
    values = [v for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return {"min": min(values), "max": max(values), "n": len(values)} if values else None
