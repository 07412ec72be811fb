"""Helpers the test files share, in one place: plain functions and constants, imported as
`from helpers import ...` (pytest puts tests/ on the path). Fixtures are in conftest.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from quantstudy import config as qc

ROOT = Path(__file__).resolve().parent.parent


TEST_CONFIG = ROOT / ".test" / "config.yaml"


def study_doc(family: str = "fnet") -> dict:
    """A study's spec with the embedded default's tiny override merged over it, not yet validated: what a
    test edits into a bad config."""
    return qc.deep_merge(yaml.safe_load((ROOT / f"config/studies/{family}.yaml").read_text()),
                         yaml.safe_load((ROOT / f"config/tiny/{family}.yaml").read_text()))


# The tiny FNet setting and the CPU torch target, as the rules hand them to a step.
FNET_SETTING = {"name": "w64", "batch": 1, "shape": {"window": 64}, "quality": True}
CPU_TORCH = {"target": "cpu-torch", "backend": "torch", "device": "cpu"}


def ident(variant: str, model: str = "fnet-base", setting: str = "w64", target: str = "cpu-torch") -> dict:
    """What a per-variant step is told of its job (the rules' variant_ident)."""
    return {"target": target, "model": model, "setting": setting, "variant": variant}


def scaled(samples: list[float], factor: float) -> list[float]:
    """Timing samples `factor` times slower (below 1: faster)."""
    return [t * factor for t in samples]


def tiny_checkpoint(family, architecture: dict | str, folder: Path, tiny: dict | None = None) -> Path:
    """A family's tiny checkpoint of `architecture` (a recorded one's name, or the dict) and its `tiny`
    spec (default {"seed": 0}), written as files to `folder` and loaded from there like a real one."""
    if isinstance(architecture, str):
        architecture = qc.load_architecture(architecture)
    for name, data in family.tiny_checkpoint_files(architecture, tiny or {"seed": 0}).items():
        (folder / name).write_bytes(data)
    return folder


def observed_amax(model, batches: list[dict]) -> dict:
    """An amax document from forward hooks: the per-tensor max of every linear layer's input (every
    call, over the batches) and weight, the statistic max calibration keeps. Tests of graphs use
    it; ModelOpt itself is exercised by the calibrate step."""
    import torch

    amax, hooks = {}, []
    for name, m in model.named_modules():
        if isinstance(m, torch.nn.Linear):
            amax[name] = {"input_amax": 0.0, "weight_amax": float(m.weight.detach().abs().max())}

            def hook(_m, inp, _out, name=name):
                amax[name]["input_amax"] = max(amax[name]["input_amax"], float(inp[0].detach().abs().max()))
            hooks.append(m.register_forward_hook(hook))
    try:
        with torch.no_grad():
            for batch in batches:
                model(**batch)
    finally:
        for h in hooks:
            h.remove()
    return {"amax": amax, "outliers": {"layers": []}}


def rewritten(source: Path | dict, out: Path, edit=None) -> Path:
    """An artifact (its path, or its doc as read) with `edit(body)` applied, written again to `out` by
    write_json: its content digest matches the edit, so only a reader's other checks can tell (a file
    made by hand or by another tool)."""
    import json

    from quantstudy import artifacts

    doc = json.loads(Path(source).read_text()) if isinstance(source, (str, Path)) else source
    body = {k: v for k, v in doc.items() if k not in ("schema", "schema_version", artifacts.DIGEST)}
    if edit:
        edit(body)
    artifacts.write_json(out, doc["schema"], body)
    return out


def reference_qdq(x, scale: float):
    """Float64 QuantizeLinear to float8_e4m3fn (round half to even, saturate to +-448) then
    DequantizeLinear, from the format's table of values rather than torch's cast: what an FP8 layer's
    Q/DQ should give, worked out apart from quantstudy.quantization.

    The scale is the float32 value the graph stores; the quotient x/scale is float32, as in ONNX.
    """
    import torch

    table = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).to(torch.float64)
    scale = float(torch.tensor(scale, dtype=torch.float32))
    grid, bits = table[torch.isfinite(table)], torch.arange(256)[torch.isfinite(table)]
    order = torch.argsort(grid)
    grid, bits = grid[order], bits[order]
    v = (x.to(torch.float32) / torch.tensor(scale, dtype=torch.float32)).to(torch.float64).clamp(-448, 448)
    idx = torch.searchsorted(grid, v).clamp(1, len(grid) - 1)
    lo, hi = grid[idx - 1], grid[idx]
    pick_hi = (hi - v < v - lo) | ((hi - v == v - lo) & (bits[idx] % 2 == 0))
    return torch.where(pick_hi, hi, lo) * scale


# Backends as the suites name them: "torch-cuda" is the torch backend on a GPU with FP8 (real
# _scaled_mm GEMMs, compiled, CUDA graph).
ON_GPU = {"tensorrt", "torch-cuda"}
# Backends whose libraries pyproject.toml pins: they import on every machine that installed it
# (TensorRT's cannot be installed here, so its tests skip where it does not import).
PINNED_BACKENDS = {"torch", "onnxruntime"}


def backend_or_skip(name: str):
    """The backend module of a suite's backend name, or a skip saying why it cannot run here."""
    import torch

    from quantstudy import backends

    module = name.removesuffix("-cuda")
    ok, why = backends.available(module)
    if not ok and module in PINNED_BACKENDS:  # a broken install is a failure, not a skip
        pytest.fail(f"backend {module} is pinned in pyproject.toml but does not import: {why}")
    if not ok:
        pytest.skip(why)  # "backend tensorrt does not import here: ..."
    if name in ON_GPU and not torch.cuda.is_available():
        skip_without_gpu(f"backend {name} needs a CUDA GPU; torch sees none here")
    if name == "torch-cuda" and torch.cuda.get_device_capability() < (8, 9):
        skip_without_gpu("torch-cuda needs FP8 GEMMs (compute capability 8.9+)")
    return backends.get(module)


def target_for(name: str):
    """A target for a suite's backend name; TensorRT's timing cache outside the repository's resources/."""
    import tempfile

    from quantstudy.config import Target

    return Target(name=f"test-{name}", backend=name.removesuffix("-cuda"),
                  device="cuda" if name in ON_GPU else "cpu", compile=name == "torch-cuda",
                  builder={"timing_cache_dir": str(Path(tempfile.gettempdir()) / "quantstudy-test-tensorrt-cache")})


def skip_without_gpu(reason: str) -> None:
    """Skip a test that needs a GPU this machine lacks; with QUANTSTUDY_REQUIRE_GPU=1 (GPU evidence
    runs), fail instead, so that a GPU path cannot go unnoticed where a GPU should be."""
    if os.environ.get("QUANTSTUDY_REQUIRE_GPU"):
        pytest.fail(f"QUANTSTUDY_REQUIRE_GPU is set, but {reason}")
    pytest.skip(reason)


def stand_in_lock(path: Path, run_configs: list[str]) -> list[str]:
    """A lock file at `path` with a STAND-IN commit for every revision these run configs leave to the
    lock step (the hub that would resolve them cannot be reached here): each begins with the short
    hash asked for and is otherwise the sha1 of its key. For tests of what a locked run does; the
    commits name nothing on the hub. Returns the keys."""
    import hashlib

    from quantstudy import lock, lockfile

    entries = {}
    for req in lock.requests_of(run_configs):
        digest = hashlib.sha1(req.key.encode()).hexdigest()
        commit = (req.requested or "") + digest[len(req.requested or ""):]
        entries[req.key] = {"type": req.repo_type, "repo": req.repo, "requested": req.requested, "commit": commit,
                            "how": "stand-in for a test"}
    lockfile.write(entries, path)
    return sorted(entries)


def dry_run_with_studies(tmp_path: Path, studies: dict):
    """`snakemake -n` of the checkout's Snakefile in `tmp_path`, on the embedded default with these
    studies (run-config entries): what a user's bad config does before any job."""
    import subprocess
    import sys

    run = yaml.safe_load((ROOT / "config/config.yaml").read_text())
    run["studies"] = studies
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(run))
    return subprocess.run([sys.executable, "-m", "snakemake", "-n", "--cores", "1", "--snakefile", str(ROOT / "Snakefile"),
                           "--directory", str(tmp_path), "--configfile", str(tmp_path / "config.yaml")],
                          capture_output=True, text=True)


def assert_declares_its_quality_columns(family, evaluation, reference_blocks: dict, evaluation_samples,
                                        against=()) -> None:
    """What a family's reference and evaluate wrote is what it declares (Family.quality_columns): the
    config check lets a decision condition name those columns and no other."""
    from quantstudy.aggregate_rows import flatten

    declared = family.quality_columns(list(evaluation_samples), list(against))
    named = lambda blocks: {f"{b}.{m}" for b, metrics in blocks.items() for m in metrics}
    assert set(flatten(evaluation.blocks)) == named(declared.blocks)
    assert set(evaluation.nonfinite) == set(declared.nonfinite)
    assert set(flatten(reference_blocks)) == named(declared.reference)
