"""quantstudy diff on two small runs written by hand: one row regressed beyond the noise, one moved within it,
one row in one run only."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from quantstudy import diff

SPEC = {"settings": {"w128": {"window": 128, "batch": 1}},
        "timing": {"min_effect": {"x": 0.05, "ms": 0.10}},
        "decision": {"conditions": [
            {"name": "speed-up", "table": "speed", "column": "x", "reduce": "min", "compare": ">=", "threshold": 1.1},
            {"name": "agreement", "table": "quality", "column": "mlm.top1_agreement", "reduce": "min",
             "compare": ">=", "threshold": 0.9}]}}
ROUNDS = [1.0, 1.01, 0.99, 1.0, 1.005, 0.995, 1.0, 1.01, 0.99]  # a steady engine at 1 ms


def write_run(root: Path, x_by_variant: dict[str, float], agreement: dict[str, float]) -> Path:
    """A run folder: results/fnet/tables.json, and a timing.json per timed variant (fp16 baseline at 1.2 ms,
    each variant at 1.2 / x ms, every round within 1%; its baseline timed beside it in each job)."""
    results = root / "results"
    speed, quality = [], []
    for variant, x in x_by_variant.items():
        source = f"results/fnet/cpu-torch/fnet-base/w128/{variant}/timing.json"
        base, mine = [1.2 * r for r in ROUNDS], [1.2 / x * r for r in ROUNDS]
        graph = {"x": statistics.median(base) / statistics.median(mine),
                 "variant_ms": {"median_ms": statistics.median(mine), "samples_ms": mine},
                 "baseline_ms": {"median_ms": statistics.median(base), "samples_ms": base}}
        doc = {"status": "ok", "target": "cpu-torch", "model": "fnet-base", "setting": "w128", "variant": variant,
               "baseline": "fp16", "graphs": {"main": graph}}
        (root / source).parent.mkdir(parents=True, exist_ok=True)
        (root / source).write_text(json.dumps(doc))
        speed.append({"target": "cpu-torch", "model": "fnet-base", "setting": "w128", "variant": variant,
                      "graph": "main", "status": "ok", "baseline": "fp16", "x": graph["x"], "source": source,
                      "timing_sources": [source]})
    for variant, value in agreement.items():
        quality.append({"target": "cpu-torch", "model": "fnet-base", "setting": "w128", "variant": variant,
                        "status": "ok", "mlm.top1_agreement": value, "mlm.rows": 64, "window": 128})
    tables = {"spec": SPEC, "speed": speed, "quality": quality, "decision": {"ship": True}}
    (results / "fnet").mkdir(parents=True, exist_ok=True)
    (results / "fnet/tables.json").write_text(json.dumps(tables))
    return results


@pytest.fixture
def runs(tmp_path):
    a = write_run(tmp_path / "a", {"fp16": 1.0, "fp8": 1.5, "fp8-no-output": 1.3},
                  {"fp16": 0.99, "fp8": 0.95, "fp8-no-output": 0.96})
    # fp8: x 1.5 -> 1.2, 20% slower; fp8-no-output: 1.3 -> 1.32, within the minimum effect; fp8-new: B only
    b = write_run(tmp_path / "b", {"fp16": 1.0, "fp8": 1.2, "fp8-no-output": 1.32, "fp8-new": 1.4},
                  {"fp16": 0.99, "fp8": 0.90, "fp8-no-output": 0.96})
    return a, b


def test_a_regressed_row_counts_and_one_within_the_minimum_effect_does_not(runs):
    result = diff.diff(diff.Run.load(runs[0]), diff.Run.load(runs[1]))
    rows = {(r["row"][3], r["column"]): r for r in result["studies"]["fnet"]["rows"]}
    fp8 = rows[("fp8", "x")]
    assert fp8["estimate"] == pytest.approx(0.8) and fp8["counts"] and fp8["regressed"] and fp8["high"] < 1
    assert not rows[("fp8-no-output", "x")]["counts"] and not rows[("fp8-no-output", "x")]["regressed"]
    assert rows[("fp8", "variant_ms")]["direction"] == "higher"  # slower: its ms went up
    # the baseline's own row compares its time only: its x is 1 by definition
    assert ("fp16", "x") not in rows and ("fp16", "baseline_ms") not in rows and ("fp16", "variant_ms") in rows
    # quality: 0.95 -> 0.90 lower, where higher is better; sample counts and the window are not compared
    assert rows[("fp8", "mlm.top1_agreement")]["regressed"] and not rows[("fp16", "mlm.top1_agreement")]["counts"]
    assert ("fp8", "mlm.rows") not in rows and ("fp8", "window") not in rows
    assert result["studies"]["fnet"]["only"] == {"a": [], "b": [["cpu-torch", "fnet-base", "w128", "fp8-new", "main"]]}


def test_the_exit_status_gates_on_the_named_columns(runs, tmp_path, capsys):
    a, b = map(str, runs)
    assert diff.main([a, b, "--out", str(tmp_path / "d.md")]) == 0  # nothing named: report only
    assert diff.main([a, b, "--out", str(tmp_path / "d.md"), "--fail-on", "x"]) == 1
    assert "regressed: fnet cpu-torch / fnet-base / w128 / fp8 / main x: 1.5 -> 1.2" in capsys.readouterr().err
    # B against A: fp8's x went up, not down: no regression of x (its agreement went up too)
    assert diff.main([b, a, "--out", str(tmp_path / "d.md"), "--fail-on", "x", "--fail-on", "mlm.top1_agreement"]) == 0
    page = (tmp_path / "d.md").read_text()
    assert "| cpu-torch / fnet-base / w128 / fp8 / main | x | 1.2 | 1.5 | x1.25 |" in page
    assert "Only in A: cpu-torch / fnet-base / w128 / fp8-new / main" in page
    assert (tmp_path / "d.html").read_text().count("<table>") == 1


def test_a_folder_without_tables_is_a_clear_error(tmp_path):
    with pytest.raises(SystemExit, match="holds no <study>/tables.json"):
        diff.Run.load(tmp_path)
