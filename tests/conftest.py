"""Shared fixtures: the tiny study's pinned inputs, made by the package's own steps; and the summary
hook of the contract suite. Plain helpers that test files import are in helpers.py."""

from __future__ import annotations

import pytest
import yaml

from quantstudy import config as qc, steps

from helpers import TEST_CONFIG


@pytest.fixture
def one_cpu_thread():
    """One intra-op thread, as the workflow's jobs run on a CPU-only host (steps.job_settings): on a
    loaded machine with few cores, more threads make a small GEMM's time many times slower."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)



@pytest.fixture(autouse=True, scope="session")
def _code_checks_outside_the_checkout(tmp_path_factory):
    """The tests' config loads record their passed checks in a temporary folder, not in .snakemake/."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(qc, "CODE_CHECKS", tmp_path_factory.mktemp("checked-against-code"))
        yield



@pytest.fixture(scope="session")
def test_run() -> qc.Run:
    return qc.load_run(yaml.safe_load(TEST_CONFIG.read_text()))



@pytest.fixture(scope="session")
def tiny_inputs(tmp_path_factory, test_run):
    """Tiny checkpoint and every sample list of the test study, from a fresh local HF cache (local_hub, fetch_*)."""
    out = tmp_path_factory.mktemp("tiny")
    study = test_run.studies["fnet"]
    cache = str(out / "hf-cache")
    steps.local_hub(study.family, cache_dir=cache, out=str(out / "local_hub.json"), models=study.local_hub_models(),
                    datasets=study.local_hub_datasets())
    model = study.models["fnet-base"]
    steps.fetch_checkpoint(model.repo, model.revision, cache, True, test_run.weights, str(out / "checkpoint.json"))
    samples = {}  # every sample set of the study: {name: its sample list's path}
    for name in ("calibration", *study.evaluation_samples):
        samples[name] = out / f"{name}.json"
        steps.fetch_dataset(name, study.samples[name].as_params(), study.sample_dataset(name).as_params(), study.family, cache, True,
                            str(out / "checkpoint.json"), str(samples[name]))
    return {"dir": out, "study": study, "checkpoint": out / "checkpoint.json",
            "calibration": samples["calibration"], "samples": samples}



def pytest_terminal_summary(terminalreporter):
    """The contract suite's families x backends, as they ran here (passed, or skipped with why)."""
    import sys

    contract = sys.modules.get("test_contract")
    results = getattr(contract, "RESULTS", [])
    if not results:
        return
    families = sorted({f for f, _, _ in results})
    backends = list(dict.fromkeys(b for _, b, _ in results))
    terminalreporter.section("family contract: families x backends")
    for f in families:
        outcome = {b: sorted({o for ff, bb, o in results if ff == f and bb == b}) for b in backends}
        terminalreporter.line(f"{f:18s} " + "  ".join(f"{b}: {'/'.join(outcome[b]) or '-'}" for b in backends))
