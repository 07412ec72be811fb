"""Cluster execution: the profiles, and the workflow's DAG run through a real Slurm.

The Slurm test starts a single-node Slurm (scripts/slurm/start_test_cluster.sh, root only),
runs a whole DAG through a profile derived from slurm-b200 that differs only in partition and
GPU model, and checks against Slurm's own record that every job was submitted with sbatch,
that the GPU rules asked for a GPU, and that the results equal a local run's. Without root or the
Slurm packages it skips, unless QUANTSTUDY_REQUIRE_SLURM=1 (CI),
where that is a failure. Its wall time, one GPU and one CPU sbatch line and the Slurm records
go to logs/test_slurm/summary.md.

The DAG is the workflow tests' run less the variants that only repeat its rules (.test/slurm.yaml: the
FNet study on one tiny model at one setting, two targets, the baseline, the candidate, the fp16 build that
returns NaN at 512 and a variant that fails to build; 41 jobs, every rule of the workflow but `rebuild`) on a node of four
test GPUs; each GPU job must have had a card of its own. Through Slurm every job is a process of its own
that imports torch (8 s a job on 2 cores), so a larger DAG costs CI minutes and tests no more rules: the
workflow tests' whole run (51 jobs) took 639 s on an AVX2-only 2-core VM (2026-12-06), CI's slowest test.
QS_SLURM_TEST_CONFIG=config/config.yaml runs the whole embedded default (about 380 jobs).
"""
import copy
import difflib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from pprint import pformat

import pytest
import yaml

from helpers import stand_in_lock
from quantstudy import aggregate_bound
from quantstudy.devtools import copy_checkout

ROOT = Path(__file__).resolve().parents[1]
START = ROOT / "scripts/slurm/start_test_cluster.sh"
STOP = ROOT / "scripts/slurm/stop_test_cluster.sh"
PARTITION, GPU_MODEL = "test", "testgpu"  # the test cluster's names for b200's
STATE = Path(os.environ.get("QS_SLURM_STATE", "/var/tmp/quantstudy-slurm"))
MEASURED = {"timing.json", "kernels.json", "gemm.json"}  # measured per run: compared by structure only
CONFIG = os.environ.get("QS_SLURM_TEST_CONFIG", ".test/slurm.yaml")


def load_profile(name):
    return yaml.safe_load((ROOT / name / "config.yaml").read_text())


def gpu_rules(profile):
    return {rule for rule, res in profile["set-resources"].items() if res.get("gpu")}


def rename(profile, partition, gpu_model):
    """The profile with its partition and GPU model replaced, and nothing else."""
    out = copy.deepcopy(profile)
    out["default-resources"]["slurm_partition"] = partition
    for res in out["set-resources"].values():
        if "gpu_model" in res:
            res["gpu_model"] = gpu_model
    return out


def copy_repo(dest):
    """What a fresh clone plus the work tree's unignored files holds: no results, no caches."""
    return copy_checkout(ROOT, dest)


def start_snakemake(*args, cwd, log):
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    with open(log, "w") as out:
        return subprocess.Popen([sys.executable, "-m", "snakemake", *args], cwd=cwd, env=env,
                                stdout=out, stderr=subprocess.STDOUT)


def finish(proc, log, timeout=3000):
    try:
        rc = proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.terminate()  # Snakemake cancels its Slurm jobs on the way out
        rc = f"timeout after {timeout} s"
    assert rc == 0, f"snakemake failed ({rc}); last lines of {log}:\n" + tail(log)


def tail(path, n=60):
    return "\n".join(Path(path).read_text(errors="replace").splitlines()[-n:])


def job_stats(log_text):
    """Snakemake's 'Job stats' table: {rule: count}."""
    table = log_text.split("Job stats:", 1)[1].split("total", 1)[0]
    return {m[1]: int(m[2]) for m in re.finditer(r"^(\w+)\s+(\d+)\s*$", table, re.M)}


def slurm_records(run_uuid):
    """Slurm's record of this run's jobs (kept by slurmctld for MinJobAge = 1 h)."""
    out = subprocess.run(["scontrol", "show", "job", "--oneliner"], check=True,
                         capture_output=True, text=True).stdout
    records = [dict(f.split("=", 1) for f in line.split() if "=" in f) for line in out.splitlines()]
    return [r for r in records if r.get("JobName") == run_uuid]


def gpu_of(repo, job_id):
    """The card Slurm gave a job: CUDA_VISIBLE_DEVICES in the environment its log prints (--verbose)."""
    log = next((repo / "logs/slurm").glob(f"rule_*/**/{job_id}.log"))
    return re.search(r"'CUDA_VISIBLE_DEVICES': '([^']*)'", log.read_text())[1]


def rule_of(comment):
    return re.fullmatch(r"rule_(.+?)(_wildcards_.*)?", comment)[1]


# A decision condition's resolution against its measured interval (decision._uncertainty): measured.
RESOLVED = {"resolved", "within_noise", "to_resolve", "interval_kind"}


def deterministic(path, repo):
    """A result file's content less what legitimately differs between two runs: provenance (and
    the content digest, which covers it),
    the repository's path, and what was measured. Timing and kernel files keep their fields,
    status and list lengths; in tables.json the speed, kernel and decision numbers are masked.
    README numbers are all masked: each one is rendered from a JSON compared here (Jinja only); so is
    each JSON file's sha256 that another records (it covers that file's provenance), and the plot and
    the files a README page inlines."""
    if path.suffix == ".png":  # the plot draws the measured numbers
        return "a PNG"
    text = path.read_text(errors="replace").replace(str(repo), "<repo>")
    if path.suffix in (".md", ".html", ".rst"):  # .rst: the report's front page, the decisions
        # The page inlines the plot and every file it links: each is compared here on its own.
        text = re.sub(r"data:[a-z/]+;base64,[A-Za-z0-9+/=]+", "<a file>", text)
        text = re.sub(r'<pre id="file-[^"]*">.*?</pre>', "<a file>", text, flags=re.S)
        text = re.sub(r"\b[0-9a-f]{64}\b", "<sha256>", text)  # a sample list's: it covers its provenance
        text = re.sub(r"\d+(\.\d+)?(e[-+]?\d+)?", "#", text)
        text = re.sub(r"#([x%]?) to #\1", r"#\1", text)  # a range of measured values may be one value
        # Whether x reached its Amdahl bound is read from measured x; whether the bound is computed at all
        # from whether the baseline's profile agrees with its timing (measured): both are verdicts, masked.
        text = re.sub(r": (hardware limit|(\*\*engine\*\*|<strong>engine</strong>) \(x is #% of it\))", ": <bound>", text)
        text = re.sub(r"#(: <bound>)? \(f #%[^)]*\)", "<bound>", text)
        text = re.sub(r"withheld: the baseline's profile totals # ms a call, # x the # ms its timing measured",
                      "<bound>", text)
        text = re.sub(r"; bound:? <bound>", "; bound <bound>", text)
        text = re.sub(r"(Amdahl bound at batch # \(the x the FP# GEMMs' own speed-up allows\)(</td>\s*<td>| \|) ?-"
                      r"(</td>\s*<td>| \| ))(not measured|#x)", r"\1<bound>", text)
        text = re.sub(r", (\*\*disagrees\*\*|<strong>disagrees</strong>)", "", text)
        # f's basis is listed for the targets whose bound was computed, which the same verdict decides.
        text = re.sub(r"f was found\s.*?\.(?=\n|</p>)", "f was found <bases>.", text, flags=re.S)
        text = re.sub(r"no row has one: its cell says why\.", "f was found <bases>.", text)
        # whether a condition is met, not met or within the noise rests on measured intervals
        text = re.sub(r"(\*\*|<strong>)(met|not met|within the noise of this run): ", r"\1<resolved>: ", text)
        text = re.sub(r"The verdict rests on .*? within the noise of this run \(.*?\): there the measured value decides, "
                      r"not a difference this run can tell from noise\.\s*", "", text, flags=re.S)
        text = re.sub(r" Its measured value (meets|misses) the bar, inside the noise: this run cannot resolve it; "
                      r"about .*? would\.", "", text, flags=re.S)
        return re.sub(r"(<p>)?((\*\*|<strong>)# of the # profiles disagree|Every one of the # profiles agrees).*?"
                      r"(\n\n|</p>\n?)", "", text, flags=re.S)
    if path.suffix != ".json":
        return text

    masked_keys = {"speed", "kernels", "decision", "bound", "timing_noise"} if path.name == "tables.json" else set()
    # A speed row's bound is computed or withheld by whether its baseline's profile agrees with its timing;
    # so are the bases of f listed per target (bound.f_bases).
    verdicts = {*aggregate_bound.BOUND_COLUMNS, "f_bases"} if path.name == "tables.json" else set()

    def strip(x, measured=False, lengths=False):
        if isinstance(x, dict):  # a file's sha256 (an amax file, a sample list) covers its provenance
            return {k: "<bound>" if measured and k in verdicts else "<resolved>" if measured and k in RESOLVED else
                    strip(v, measured or k in masked_keys, lengths) if not k.endswith("sha256") else "sha256"
                    for k, v in x.items() if k not in ("provenance", "content_sha256", "measuring")}
        if isinstance(x, list):
            return len(x) if lengths else [strip(v, measured, lengths) for v in x]
        if measured and isinstance(x, (int, float)):  # a bool too: at_limit, pass
            return type(x).__name__
        return x

    data = json.loads(text)
    return strip(data, measured=path.name in MEASURED, lengths=path.name in MEASURED)


def results(repo):
    base = repo / "results"
    return {p.relative_to(base).as_posix(): deterministic(p, repo)
            for p in sorted(base.rglob("*")) if p.is_file()}


def assert_same_results(on_slurm, local):
    """Name the files that differ and show the first difference, not two 150-file dicts."""
    only = sorted(set(on_slurm) ^ set(local))
    differ = sorted(k for k in set(on_slurm) & set(local) if on_slurm[k] != local[k])
    if only or differ:
        first = differ[0] if differ else None
        diff = "" if first is None else "\n".join(difflib.unified_diff(
            pformat(local[first]).splitlines(), pformat(on_slurm[first]).splitlines(),
            "local/" + first, "on_slurm/" + first, lineterm="", n=2))
        pytest.fail(f"in one run only: {only}\ndiffering: {differ}\n{diff[:6000]}")


def skip_or_fail(reason):
    if os.environ.get("QUANTSTUDY_REQUIRE_SLURM") == "1":
        pytest.fail(f"Slurm test required but: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def slurm_cluster():
    if sys.platform != "linux" or os.geteuid() != 0:
        skip_or_fail("the Slurm test starts slurmctld/slurmd/munge and needs root on Linux")
    r = subprocess.run(["bash", str(START)], capture_output=True, text=True, timeout=900,
                       env={**os.environ, "QS_SLURM_PARTITION": PARTITION,
                            "QS_SLURM_GPU_MODEL": GPU_MODEL, "QS_SLURM_STATE": str(STATE)})
    if r.returncode == 77:
        skip_or_fail(r.stderr.strip())
    assert r.returncode == 0, f"test cluster did not start:\n{r.stdout}\n{r.stderr}"
    yield
    subprocess.run(["bash", str(STOP)], env={**os.environ, "QS_SLURM_STATE": str(STATE)},
                   capture_output=True, timeout=120)


def test_b300_profile_is_b200_renamed():
    b200, b300 = load_profile("slurm-b200"), load_profile("slurm-b300")
    assert b200["configfile"] == "config/b200.yaml" and b300["configfile"] == "config/b300.yaml"
    assert rename({**b200, "configfile": None}, "b300", "b300") == {**b300, "configfile": None}


@pytest.mark.parametrize("name, targets", [("slurm-b200", {("b200", "11.4"), ("b200", "11.1")}),
                                           ("slurm-b300", {("b300", "11.4"), ("b300", "11.1")})])
def test_profile_targets_match_the_write_ups(name, targets):
    """B200: TensorRT 11.4 and 11.1; B300: TensorRT 11.4, and 11.1 for GPT-Neo (its write-up's third
    target; config/targets/gpt-neo-b300.yaml); each version in its own env file."""
    run = yaml.safe_load((ROOT / load_profile(name)["configfile"]).read_text())
    assert {(t["gpu"], t["version"]) for t in run["targets"].values()} == targets
    for t in run["targets"].values():
        assert t["backend"] == "tensorrt" and t["env"] == f"envs/tensorrt-{t['version']}.yaml"
        assert (ROOT / t["env"]).is_file()


def test_profiles_request_gpus_the_plugin_way():
    for name, model in [("slurm-b200", "b200"), ("slurm-b300", "b300")]:
        profile = load_profile(name)
        assert profile["executor"] == "slurm"
        assert gpu_rules(profile) == {"reference", "calibrate", "build", "time", "profile", "gemm", "evaluate"}
        for rule, res in profile["set-resources"].items():
            assert "slurm_extra" not in res  # the plugin refuses GPU flags there
            assert res.get("gpu_model", model) == model
            assert {"runtime", "mem_mb", "cpus_per_task"} <= set(res)
        assert {"runtime", "mem_mb", "cpus_per_task", "slurm_partition"} <= set(profile["default-resources"])


@pytest.mark.parametrize("name", ["slurm-b200", "slurm-b300"])
def test_profile_dry_run_from_root(name, tmp_path):
    """`snakemake --profile NAME -n` from the root of a fresh copy: GPU rules carry the GPU."""
    profile = load_profile(name)
    if not (ROOT / profile["configfile"]).exists():
        pytest.skip(f"{profile['configfile']} is not in the repository yet")
    repo = copy_repo(tmp_path)
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}"}
    dry_run = lambda: subprocess.run([sys.executable, "-m", "snakemake", "--profile", name, "-n"], cwd=repo,
                                     env=env, capture_output=True, text=True, timeout=600)
    # Revisions the write-ups leave unpinned stop the run until the lock step has resolved them;
    # then (stand-in commits: no hub here) the DAG is planned.
    keys = stand_in_lock(repo / "config/revisions.lock.yaml", [str(repo / profile["configfile"])])
    if keys:
        (repo / "config/revisions.lock.yaml").unlink()
        r = dry_run()
        assert r.returncode != 0 and "unresolved revisions" in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
        stand_in_lock(repo / "config/revisions.lock.yaml", [str(repo / profile["configfile"])])
    r = dry_run()
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    text = r.stdout + r.stderr
    stats = job_stats(text)
    assert gpu_rules(profile) <= set(stats), stats
    model = profile["set-resources"]["build"]["gpu_model"]
    for block in re.split(r"\n(?=(?:local)?rule \w+:)", text):
        m = re.match(r"(?:local)?rule (\w+):", block)
        if m and m[1] in gpu_rules(profile):
            assert f"gpu=1, gpu_model={model}" in block, block
        elif m and "resources:" in block:
            assert "gpu" not in block.split("resources:", 1)[1].split("\n", 1)[0], block


@pytest.mark.workflow
def test_dag_through_slurm(slurm_cluster, tmp_path):
    profile = rename(load_profile("slurm-b200"), PARTITION, GPU_MODEL)
    (tmp_path / "slurm-test").mkdir()
    (tmp_path / "slurm-test/config.yaml").write_text(yaml.safe_dump(profile, sort_keys=False))
    on_slurm, local = copy_repo(tmp_path / "on_slurm"), copy_repo(tmp_path / "local")
    slurm_log, local_log = tmp_path / "slurm.log", tmp_path / "local.log"

    started = time.monotonic()
    local_run = start_snakemake("--cores", "2", "--configfile", CONFIG, cwd=local, log=local_log)
    try:
        slurm_run = start_snakemake("--profile", str(tmp_path / "slurm-test"), "--configfile", CONFIG,
                                    "--verbose", cwd=on_slurm, log=slurm_log)
        finish(slurm_run, slurm_log)
        wall = time.monotonic() - started
        finish(local_run, local_log)
    finally:
        if local_run.poll() is None:
            local_run.terminate()

    text = slurm_log.read_text()
    run_uuid = re.search(r"SLURM run ID: (\S+)", text)[1]
    stats = job_stats(text)
    ran_locally = set(re.findall(r"^localrule (\w+):", text, re.M))
    sbatch = {rule_of(m[1]): m[0] for m in re.finditer(r"sbatch call: sbatch .*?--comment (\S+).*", text)}
    records = slurm_records(run_uuid)
    per_rule = {}
    for r in records:
        per_rule.setdefault(rule_of(r["Comment"]), []).append(r)

    # Every job but the target rule went through sbatch, and Slurm ran each to completion; the DAG
    # took every rule of the workflow but `rebuild` (a build-to-build repeat no tiny config asks for).
    assert ran_locally <= {"all"}, ran_locally
    rules = subprocess.run([sys.executable, "-m", "snakemake", "--list-rules"], cwd=on_slurm,
                           capture_output=True, text=True, check=True).stdout.split()
    assert set(stats) == set(rules) - {"rebuild"}, sorted(set(rules) ^ set(stats))
    assert {rule: len(rs) for rule, rs in per_rule.items()} == {
        rule: n for rule, n in stats.items() if rule not in ran_locally}
    assert all(r["JobState"] == "COMPLETED" and r["Partition"] == PARTITION for r in records)
    jobcomp = (STATE / "jobcomp.log").read_text()
    for r in records:
        assert re.search(rf"^JobId={r['JobId']} .*JobState=COMPLETED", jobcomp, re.M)

    # The GPU rules asked Slurm for one GPU of the model; the CPU rules for none.
    gpus = gpu_rules(profile)
    assert gpus <= set(per_rule)
    for rule, rs in per_rule.items():
        for r in rs:
            assert (r.get("TresPerJob") == f"gres:gpu:{GPU_MODEL}:1") == (rule in gpus), r
        assert (f"--gpus={GPU_MODEL}:1" in sbatch[rule]) == (rule in gpus), sbatch[rule]

    # One GPU job per card: GPU jobs that ran at the same time had different cards.
    gpu_jobs = sorted((r for r in records if r.get("TresPerJob")), key=lambda r: r["StartTime"])
    card = {r["JobId"]: gpu_of(on_slurm, r["JobId"]) for r in gpu_jobs}
    side_by_side = [(a, b) for i, a in enumerate(gpu_jobs) for b in gpu_jobs[i + 1:]
                    if b["StartTime"] < a["EndTime"]]
    assert side_by_side, "the GPU jobs never ran side by side"
    for a, b in side_by_side:
        assert card[a["JobId"]] != card[b["JobId"]], (a, b)

    # Same results as the local run, less provenance and measured times.
    assert_same_results(results(on_slurm), results(local))

    summary = ROOT / "logs/test_slurm/summary.md"
    summary.parent.mkdir(parents=True, exist_ok=True)
    short = lambda line: re.sub(r'^sbatch call: | --wrap=".*', "", line)  # noqa: E731
    cpu_rule = next(rule for rule in per_rule if rule not in gpus)
    summary.write_text(
        f"Slurm test ({CONFIG}): {len(records)} jobs through sbatch, wall time {wall:.0f} s "
        f"(Snakemake start to finish).\n\nGPU rule `build` (--wrap left out):\n\n    {short(sbatch['build'])}\n\n"
        f"CPU rule `{cpu_rule}`:\n\n    {short(sbatch[cpu_rule])}\n\nSlurm records:\n\n"
        + "".join(f"    {r['JobId']} {r['Comment']} {r['JobState']} "
                  f"TRES={r['TRES']} TresPerJob={r.get('TresPerJob', '-')}\n" for r in records))
    print(summary.read_text())
