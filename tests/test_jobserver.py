"""The local job server: a job's call runs in a worker forked from the warm server, with the
job's arguments, files, exit status and output, and stops when its job is killed. (That a whole
DAG gives the same results this way as with one process per job is the Slurm test's comparison.)"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from quantstudy import jobserver

from helpers import ROOT, skip_without_gpu

JOB_MODULE = textwrap.dedent("""
    import json, os, sys, time
    from quantstudy import steps

    def record(out, value):
        steps.log.info("recording %s", value)
        with open(out, "w") as f:
            json.dump({"pid": os.getpid(), "ppid": os.getppid(), "value": value, "cwd": os.getcwd(),
                       "torch_imported": "torch" in sys.modules, "env": os.environ.get("QS_TEST_VAR")}, f)

    def fail(message):
        raise RuntimeError(message)

    def on_gpu(out):
        import torch
        x = torch.arange(4.0, device="cuda")
        with open(out, "w") as f:
            json.dump({"sum": float((x @ x).item()), "device": torch.cuda.get_device_name()}, f)

    def sleep(out):
        with open(out, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)
""")


@pytest.fixture(scope="module")
def server():
    if sys.platform != "linux":
        pytest.skip("the job server needs fork (Linux)")
    proc = jobserver.start()
    assert proc is not None, "the job server did not start (its reason is on stderr)"
    address = os.environ[jobserver.ADDRESS]
    yield proc, address
    jobserver.stop(proc)
    assert proc.poll() is not None and not os.path.exists(address)


def job(tmp_path, call: str, address: str | None, **popen):
    """A job's script, as Snakemake runs it: its own Python process in the job's directory."""
    (tmp_path / "jobmodule.py").write_text(JOB_MODULE)
    env = {k: v for k, v in os.environ.items() if k != jobserver.ADDRESS}
    env.update({"QS_TEST_VAR": "from the job", **({jobserver.ADDRESS: address} if address else {})})
    code = f"import sys; sys.path.insert(0, {str(tmp_path)!r}); from quantstudy.jobserver import run; {call}"
    return subprocess.Popen([sys.executable, "-c", code], cwd=tmp_path, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def test_a_job_runs_in_a_worker_of_the_server(server, tmp_path):
    proc, address = server
    p = job(tmp_path, "run('jobmodule:record', 'job.log', out='out.json', value={'a': [1, 2]})", address)
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 0, stderr
    seen = json.loads((tmp_path / "out.json").read_text())
    assert seen["ppid"] == proc.pid and seen["pid"] != p.pid  # forked from the server, not the job
    assert seen["torch_imported"]  # the server's imports come with it
    assert seen == {**seen, "value": {"a": [1, 2]}, "cwd": str(tmp_path), "env": "from the job"}
    log = (tmp_path / "job.log").read_text()
    assert "recording {'a': [1, 2]}" in log and "job server worker: max RSS" in log


def test_without_a_server_the_job_runs_in_its_own_process(tmp_path):
    p = job(tmp_path, "run('jobmodule:record', 'job.log', out='out.json', value=1)", address=None)
    assert p.wait(timeout=120) == 0, p.stderr.read()
    assert json.loads((tmp_path / "out.json").read_text())["pid"] == p.pid
    assert "recording 1" in (tmp_path / "job.log").read_text()


def test_a_failing_job_fails_with_its_traceback(server, tmp_path):
    p = job(tmp_path, "run('jobmodule:fail', 'job.log', message='the reason it failed')", server[1])
    stdout, stderr = p.communicate(timeout=60)
    assert p.returncode == 1
    assert "RuntimeError: the reason it failed" in stderr  # the job's stderr is the worker's


def test_a_killed_job_stops_its_worker(server, tmp_path):
    p = job(tmp_path, "run('jobmodule:sleep', None, out='pid')", server[1], start_new_session=True)
    pid_file = tmp_path / "pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text():
        assert time.monotonic() < deadline and p.poll() is None, p.stderr.read()
        time.sleep(0.1)
    worker = int(pid_file.read_text())
    os.killpg(p.pid, signal.SIGKILL)  # as Snakemake cancels a job
    p.wait()
    deadline = time.monotonic() + 10
    while _alive(worker):
        assert time.monotonic() < deadline, "the worker outlived its job"
        time.sleep(0.1)


def test_a_worker_uses_the_gpu(server, tmp_path):
    """The server never touches CUDA, so a forked worker initializes it as a fresh process would."""
    import torch

    if not torch.cuda.is_available():
        skip_without_gpu("no CUDA device")
    p = job(tmp_path, "run('jobmodule:on_gpu', 'job.log', out='out.json')", server[1])
    stdout, stderr = p.communicate(timeout=120)
    assert p.returncode == 0, stderr
    assert json.loads((tmp_path / "out.json").read_text())["sum"] == 14.0
    assert "job server worker" in (tmp_path / "job.log").read_text()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a worker that exited but is not yet reaped is a zombie
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


def test_the_server_exits_quietly_on_a_second_sigterm_during_its_exit():
    """A call's time limit and Snakemake each send the server SIGTERM; the second arrived while the first
    exit ran its cleanup, and a traceback ("Exception ignored in atexit callback") went into the log."""
    script = textwrap.dedent("""
        import atexit, os, signal
        from quantstudy.jobserver import exit_on_sigterm
        signal.signal(signal.SIGTERM, exit_on_sigterm)
        atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))  # the second SIGTERM, during the exit
        os.kill(os.getpid(), signal.SIGTERM)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert (done.returncode, done.stderr) == (0, "")
