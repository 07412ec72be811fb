"""timing.gpu_turn, the lock behind timing.device_lock, on lock files (no GPU needed): a measurement
runs alone, after the shared GPU work that holds the GPU, and a process that holds a turn takes it
again without waiting (a runner's capture inside evaluate's shared turn)."""

from __future__ import annotations

import fcntl
import logging
import multiprocessing
import re
import time

import pytest

from quantstudy.timing import gpu_turn

FORK = multiprocessing.get_context("fork")


def _wait_for_closed_gate(lock, seconds: float = 10) -> None:
    """Until another process holds the lock's gate alone: a measurement waiting for its turn."""
    deadline = time.monotonic() + seconds
    with open(lock.with_suffix(".gate"), "a") as gate:
        while True:
            try:
                fcntl.flock(gate, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                return
            fcntl.flock(gate, fcntl.LOCK_UN)
            if time.monotonic() > deadline:
                raise TimeoutError("the measurement never closed the gate")
            time.sleep(0.01)


def _shared_work(lock, inside, measurement_waits, nested_done, released):
    with gpu_turn(lock, shared=True):
        inside.set()
        measurement_waits.wait(10)
        _wait_for_closed_gate(lock)  # the measurement now waits for the lock, its gate closed
        with gpu_turn(lock, shared=True):  # as Runner._capture inside evaluate's turn
            nested_done.value = time.monotonic()
        released.value = time.monotonic()


def _measurement(lock, inside, measurement_waits, acquired):
    inside.wait(10)
    measurement_waits.set()
    with gpu_turn(lock):
        acquired.value = time.monotonic()


def test_a_measurement_waits_for_shared_work_which_takes_its_turn_again_without_deadlock(tmp_path):
    lock = tmp_path / "gpu.lock"
    inside, waits = FORK.Event(), FORK.Event()
    nested_done, released, acquired = (FORK.Value("d", 0.0) for _ in range(3))
    work = FORK.Process(target=_shared_work, args=(lock, inside, waits, nested_done, released))
    measurement = FORK.Process(target=_measurement, args=(lock, inside, waits, acquired))
    work.start(), measurement.start()
    work.join(20), measurement.join(20)
    stuck = [p for p in (work, measurement) if p.is_alive()]
    for p in stuck:
        p.kill()
    assert not stuck, "deadlock: the nested shared turn waited at the gate the measurement closed"
    assert work.exitcode == 0 and measurement.exitcode == 0
    assert 0 < nested_done.value < released.value <= acquired.value  # the measurement ran alone, after the work


def test_a_measurement_inside_shared_work_is_refused(tmp_path):
    lock = tmp_path / "gpu.lock"
    with gpu_turn(lock, shared=True):
        with pytest.raises(RuntimeError, match="measurement inside shared GPU work"):
            with gpu_turn(lock):
                pass
    with gpu_turn(lock):  # refused without leaving the turn marked as held
        with gpu_turn(lock, shared=True):
            pass


def _hold_shared(lock, inside, seconds):
    with gpu_turn(lock, shared=True):
        inside.set()
        time.sleep(seconds)


def test_a_measurement_logs_how_long_it_waited_for_its_turn(tmp_path, caplog):
    """benchmarks/gpu_cost.py reads the wait of each measurement's turn from the job's log."""
    lock = tmp_path / "gpu.lock"
    with caplog.at_level(logging.INFO, logger="quantstudy"):
        with gpu_turn(lock):
            pass
        inside = FORK.Event()
        work = FORK.Process(target=_hold_shared, args=(lock, inside, 1.5))
        work.start()
        assert inside.wait(10)
        with gpu_turn(lock):
            pass
        work.join(10)
    waits = [float(m) for m in re.findall(r"GPU turn alone after waiting ([0-9.]+) s", caplog.text)]
    assert len(waits) == 2 and waits[0] < 0.5 and 1.0 < waits[1] < 5, caplog.text


# The CPU's turn: every workflow job holds the cores shared (jobserver.call); a step that measures
# takes them alone while it measures (timing.device_lock on a CPU target).
JOB_STEPS = '''
import time
from quantstudy.timing import device_lock, measures_speed

def hold(seconds):
    time.sleep(seconds)

@measures_speed
def measure():
    with device_lock("cpu"):
        pass

def measure_unmarked():
    with device_lock("cpu"):
        pass
'''


@pytest.fixture
def job_steps(tmp_path, monkeypatch):
    """Steps in a module of their own, run as jobs are (jobserver.call), on a CPU lock of the test's own."""
    from quantstudy import timing

    (tmp_path / "job_steps.py").write_text(JOB_STEPS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(timing, "CPU_LOCK", tmp_path / "cpu.lock")
    return timing.CPU_LOCK


def _job(target, kwargs, done):
    from quantstudy import jobserver

    jobserver.call(target, None, kwargs)
    done.value = time.monotonic()


def test_a_cpu_measurement_waits_for_the_jobs_beside_it_to_end(job_steps):
    """On 2 cores, a build beside a timing moved one engine's median up to 4x between the jobs of a run."""
    import torch  # noqa: F401  imported before the clock starts: device_lock imports it

    from quantstudy.timing import device_lock

    done = FORK.Value("d", 0.0)
    job = FORK.Process(target=_job, args=("job_steps:hold", {"seconds": 2.0}, done))
    job.start()
    deadline = time.monotonic() + 10
    while not job_steps.exists() or _free(job_steps):  # until the job holds its shared turn
        assert time.monotonic() < deadline, "the job never took its turn on the cores"
        time.sleep(0.01)
    holding = time.monotonic()  # the job holds its turn from here for about 2 s (its step sleeps)
    with device_lock("cpu"):
        acquired = time.monotonic()
    job.join(10)
    assert job.exitcode == 0 and acquired - holding > 1.5 and done.value > 0


def _free(lock) -> bool:
    with open(lock, "a") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        fcntl.flock(f, fcntl.LOCK_UN)
        return True


def test_only_a_step_marked_as_measuring_takes_the_cores_alone_in_its_job(job_steps):
    """A measuring step's job holds no shared turn (its measurement would be refused inside one); any
    other step's job does, so a measurement in it is refused rather than run beside other work."""
    from quantstudy import jobserver

    jobserver.call("job_steps:measure", None, {})
    with pytest.raises(RuntimeError, match="measurement inside shared CPU work"):
        jobserver.call("job_steps:measure_unmarked", None, {})
