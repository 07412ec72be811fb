"""A damaged artifact is named where it is read: its path, what is wrong, and how to remake it."""
from __future__ import annotations

import json

import pytest

from quantstudy import artifacts
from quantstudy.artifacts import SCHEMA_VERSION, DamagedArtifact, read_json

REMAKE = "rerun the job that writes it: snakemake --force {}"


def signed(doc: dict) -> str:
    """An artifact's text with the digest its job would write."""
    return json.dumps({**doc, artifacts.DIGEST: artifacts.content_digest(doc)})


@pytest.mark.parametrize("content, problem", [
    ('{"schema": "amax", "schema_v', "not valid JSON (Unterminated string"),
    (signed({"schema": "timing", "schema_version": SCHEMA_VERSION}), "holds a 'timing' artifact, expected 'amax'"),
    (json.dumps({"schema": "amax", "schema_version": 1}),
     f"is a amax artifact of schema version 1, this code reads version {SCHEMA_VERSION}"),
    (signed({"schema": "amax", "schema_version": SCHEMA_VERSION}), "fails the amax schema at the top level: "),
    (json.dumps({"schema": "amax", "schema_version": SCHEMA_VERSION}),
     "has no content_sha256, the digest its job writes: it was not written by that job"),
    ("[1, 2]", "holds a 'list' artifact, expected 'amax'"),
])
def test_a_damaged_artifact_is_named_with_how_to_remake_it(content, problem, tmp_path):
    path = tmp_path / "amax.json"
    path.write_text(content)
    with pytest.raises(DamagedArtifact) as e:
        read_json(path, "amax")
    assert str(e.value).startswith(f"{path}: {problem}") and str(e.value).endswith(REMAKE.format(path))


def test_gpu_system_reads_the_drivers_description():
    """nvidia-smi's XML (a trimmed copy of an H200's) gives the fields every GPU job records."""
    xml = """<?xml version="1.0" ?><nvidia_smi_log><driver_version>580.159.04</driver_version>
    <cuda_version>13.0</cuda_version>
    <gpu id="00000000:01:00.0"><product_name>NVIDIA A</product_name><uuid>GPU-aaaa</uuid></gpu>
    <gpu id="00000000:02:00.0"><product_name>NVIDIA H200</product_name><uuid>GPU-1234-abcd</uuid>
    <persistence_mode>Enabled</persistence_mode><compute_mode>Default</compute_mode>
    <clocks_event_reasons><clocks_event_reason_gpu_idle>Not Active</clocks_event_reason_gpu_idle>
    <clocks_event_reason_sw_power_cap>Active</clocks_event_reason_sw_power_cap></clocks_event_reasons>
    <temperature><gpu_temp>31 C</gpu_temp></temperature>
    <gpu_power_readings><current_power_limit>700.00 W</current_power_limit></gpu_power_readings>
    <clocks><graphics_clock>1980 MHz</graphics_clock><sm_clock>1980 MHz</sm_clock><mem_clock>3201 MHz</mem_clock></clocks>
    <max_clocks><graphics_clock>1980 MHz</graphics_clock><sm_clock>1980 MHz</sm_clock><mem_clock>3201 MHz</mem_clock></max_clocks>
    </gpu></nvidia_smi_log>"""
    system = artifacts.parse_nvidia_smi(xml, "1234-abcd")
    assert system["name"] == "NVIDIA H200" and system["driver"] == "580.159.04" and system["cuda_driver"] == "13.0"
    assert system["clocks_mhz"] == {"graphics": "1980 MHz", "sm": "1980 MHz", "mem": "3201 MHz"}
    assert system["clock_event_reasons_active"] == ["sw_power_cap"]
    assert system["power_limit"] == "700.00 W" and system["temperature"] == "31 C"
    assert artifacts.parse_nvidia_smi(xml)["name"] == "NVIDIA A"  # no UUID given: the first GPU


def test_a_value_edited_after_its_job_wrote_it_is_refused_on_read(tmp_path):
    """The job's digest covers every value: the artifact reads back as written, and not once edited."""
    import numpy as np

    path = tmp_path / "samples.json"
    doc = {"dataset": "wikitext", "repo": "org/data", "revision": "0" * 40, "split": "test", "kind": "passages",
           "samples": [{"id": 1, "sha256": "ab" * 32, "x": np.float32(0.1)}], "provenance": artifacts.provenance("fetch_dataset")}
    artifacts.write_json(path, "samples", doc)
    assert read_json(path, "samples")["samples"][0]["x"] == pytest.approx(0.1)
    text = path.read_text()
    assert '"id": 1' in text
    path.write_text(text.replace('"id": 1', '"id": 2'))
    with pytest.raises(DamagedArtifact, match="does not match its content_sha256: its content was edited after the job"):
        read_json(path, "samples")
    with pytest.raises(DamagedArtifact, match="was edited after the job"):  # also where the reader names no kind
        read_json(path)


def test_a_cpu_job_records_and_names_the_vector_isa_its_kernels_used():
    """A CPU timing depends on the ISA torch dispatches to (on AVX2 alone float16 GEMMs are emulated, 10 to 30
    times slower than float32): every job records it, and a README's device says it."""
    import torch

    hw = artifacts.hardware()
    assert hw["cpu_isa"] == torch.backends.cpu.get_cpu_capability()
    assert artifacts.device_name({"cpus": 2, "cpu_isa": "AVX2"}) == "CPU with AVX2"
    assert artifacts.device_name({"cpus": 2}) == "CPU"  # a job written before it was recorded
    assert artifacts.device_name({"cpu_isa": "AVX2", "gpu": "NVIDIA H100 80GB HBM3"}) == "NVIDIA H100 80GB HBM3"
    docs = [{"provenance": {"hardware": {"cpu_isa": isa}}} for isa in ("AVX2", "AVX2", "AVX512")]
    assert artifacts.devices(docs) == [{"device": "CPU with AVX2", "jobs": 2}, {"device": "CPU with AVX512", "jobs": 1}]
