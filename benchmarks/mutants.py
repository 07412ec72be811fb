"""Hand mutants against their focused tests: which wrong implementations the tests see.

Each mutant in benchmarks/mutants.yaml is a one- or few-line wrong implementation: a file, an exact
snippet of it (found exactly once), its replacement, and the focused pytest arguments that should
see it. The checkout's files (tracked, and untracked ones git does not ignore) are copied once to a
temporary folder; each mutant is applied there, its tests run, and the file restored. The checkout
itself is never edited. Each distinct test command first runs on the unmutated copy: a mutant is
only "caught" by tests that pass without it.

    .venv/bin/python benchmarks/mutants.py                    # every mutant, then the score
    .venv/bin/python benchmarks/mutants.py --only audit-      # those whose name starts so
    .venv/bin/python benchmarks/mutants.py --list

A mutant with `owner:` is expected to be caught by tests another change brings; it is counted
apart, and its line says so.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent
MUTANTS = ROOT / "benchmarks" / "mutants.yaml"


def checkout_files(root: Path) -> list[str]:
    out = subprocess.run(["git", "-C", str(root), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                         capture_output=True, check=True).stdout
    return [p for p in out.decode().split("\0") if p and (root / p).is_file()]


def copy_checkout(root: Path, dest: Path) -> None:
    for rel in checkout_files(root):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(root / rel, dest / rel)


def pytest(copy: Path, args: str, timeout: int) -> tuple[int, str, float]:
    """Run pytest in the copy, importing the copy's package; (return code, output's tail, seconds)."""
    env = {**os.environ, "PYTHONPATH": str(copy), "PYTHONDONTWRITEBYTECODE": "1"}
    started = time.monotonic()
    try:
        proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider",
                               *shlex.split(args)], cwd=copy, env=env, capture_output=True, text=True, timeout=timeout)
        rc, out = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as e:
        rc, out = -1, f"timed out after {timeout} s\n{e.stdout or ''}"
    return rc, out[-1500:], time.monotonic() - started


def first_failure(output: str) -> str:
    """The line pytest names the first failing test with, for the report."""
    lines = [line for line in output.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return lines[0][:160] if lines else output.strip().splitlines()[-1][:160] if output.strip() else ""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="only the mutants whose name starts with this")
    parser.add_argument("--list", action="store_true", help="list the mutants and their tests, run nothing")
    parser.add_argument("--timeout", type=int, default=900, help="seconds one pytest run may take")
    parser.add_argument("--keep", action="store_true", help="keep the temporary copy (its path is printed)")
    args = parser.parse_args(argv)

    mutants = yaml.safe_load(MUTANTS.read_text())
    if args.only:
        mutants = [m for m in mutants if m["name"].startswith(args.only)]
    # A snippet that no longer occurs exactly once is a stale mutant (the code moved on), never a caught one.
    stale = {m["name"]: (ROOT / m["file"]).read_text().count(m["original"]) for m in mutants}
    stale = {name: n for name, n in stale.items() if n != 1}
    if args.list:
        for m in mutants:
            print(f"{m['name']:50s} {m['file']:28s} pytest {m['tests']}"
                  + (f"  (STALE: its snippet occurs {stale[m['name']]} times)" if m["name"] in stale else ""))
        return 0

    copy = Path(tempfile.mkdtemp(prefix="quantstudy-mutants-"))
    try:
        copy_checkout(ROOT, copy)
        baseline: dict[str, tuple[int, str]] = {}
        results = []
        for m in mutants:
            owner = f" [expected from {m['owner']}]" if m.get("owner") else ""
            if m["name"] in stale:
                print(f"stale    {m['name']}{owner}: its snippet occurs {stale[m['name']]} times in {m['file']}; "
                      "update benchmarks/mutants.yaml", flush=True)
                results.append((m, "stale"))
                continue
            if m["tests"] not in baseline:
                rc, out, s = pytest(copy, m["tests"], args.timeout)
                baseline[m["tests"]] = (rc, out)
                print(f"[unmutated] pytest {m['tests']}: {'passes' if rc == 0 else 'FAILS'} ({s:.0f} s)", flush=True)
            path = copy / m["file"]
            original = path.read_text()
            path.write_text(original.replace(m["original"], m["replacement"], 1))
            try:
                rc, out, s = pytest(copy, m["tests"], args.timeout)
            finally:
                path.write_text(original)
            if baseline[m["tests"]][0] != 0:
                verdict = "UNTESTED (its tests fail without the mutant)"
            elif rc == 0:
                verdict = "missed"
            elif rc == 1:
                verdict = "caught"
            else:  # 2: interrupted or a collection error (an import the mutant broke), -1: timed out
                verdict = f"error (pytest exit {rc})"
            why = f": {first_failure(out)}" if rc != 0 else ""
            print(f"{verdict:8s} {m['name']}{owner} ({s:.0f} s){why}", flush=True)
            results.append((m, verdict))
        mine = [v for m, v in results if not m.get("owner")]
        theirs = [v for m, v in results if m.get("owner")]
        print(f"\nscore: {mine.count('caught')} of {len(mine)} caught"
              + (f"; {theirs.count('caught')} of {len(theirs)} of those expected from other tests" if theirs else ""))
        missed = [m["name"] for m, v in results if v != "caught"]
        if missed:
            print("not caught: " + ", ".join(missed))
        return 0 if all(v == "caught" for m, v in results if not m.get("owner")) else 1
    finally:
        if args.keep:
            print(f"the copy: {copy}")
        else:
            shutil.rmtree(copy, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
