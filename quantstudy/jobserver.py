"""A warm process that local jobs fork from, so that each job does not import torch again.

Importing torch, Transformers and ModelOpt takes 6 to 14 s on two cores, and most jobs of the
embedded default work for well under a second. When Snakemake runs jobs on this machine (a host
without NVIDIA GPUs, see `start`), the Snakefile starts one server (`onstart`) that imports them
once and stops it at the end. A job's
script calls `run("quantstudy.steps_engines:build", log, **kwargs)`; run hands the call, the job's
working directory, environment and stdin/stdout/stderr to the server, which forks a worker for
it: the worker is the job, with the same code, arguments and files as an in-process run. Where
no server answers (a cluster job, a job in its own conda environment, a step run by hand), run
calls the function in the job's own process.

Why fork is safe here: the server only imports; it never runs a torch op or touches CUDA
(checked before it serves), so a worker starts with no thread pool and no device state.
Snakemake's benchmark files measure the job's own process; for a forked worker its CPU and
memory are written to the job's log instead.
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import resource
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from typing import Any

# The environment variable that names a running server's socket, for the jobs Snakemake starts.
ADDRESS = "QUANTSTUDY_JOB_SERVER"
PRELOAD = ("torch", "transformers", "onnx", "onnxruntime", "modelopt.torch.quantization",
           "quantstudy.steps", "quantstudy.steps_reference", "quantstudy.steps_engines",
           "quantstudy.steps_measure", "quantstudy.families", "quantstudy.backends", "quantstudy.aggregate")
# Imports that initialize CUDA where a GPU is visible (ModelOpt's GEMM kernels ask for the device's
# capability at import; measured on an H200): a forked worker could not use the GPU after them,
# so there each job imports them itself.
INITIALIZE_CUDA = ("modelopt.torch.quantization",)


def run(target: str, log_file: str | None, /, **kwargs: Any) -> None:
    """Call `module:function`(**kwargs) with the package's log lines in `log_file`: in a worker
    of the local job server if one serves this Python, else here. Exits non-zero if it raised."""
    address = os.environ.get(ADDRESS)
    if address and os.path.exists(address):
        with contextlib.suppress(ConnectionError, FileNotFoundError, _Refused):
            sys.exit(_run_in_server(address, target, log_file, kwargs))
    call(target, log_file, kwargs)


def optional(inputs: Any, name: str) -> str | None:
    """A rule input that only some of its jobs have (Snakemake's input.get), as a plain path."""
    path = inputs.get(name)
    return None if path is None else str(path)


def call(target: str, log_file: str | None, kwargs: dict[str, Any]) -> None:
    """Run one job's step. A job holds the machine's cores shared for its whole run, so that no measurement
    runs beside it; a step that measures takes them alone while it measures (timing.device_lock)."""
    from quantstudy import steps, timing

    module, function = target.split(":")
    step = getattr(importlib.import_module(module), function)
    try:
        with steps.logged(log_file), timing.job_turn(step):
            step(**kwargs)
    except Exception:
        if log_file:  # the traceback in the job's log too, not only on the terminal
            with open(log_file, "a") as f:
                f.write(traceback.format_exc())
        raise


class _Refused(Exception):
    """The server serves another Python (the job runs in its own environment)."""


def _run_in_server(address: str, target: str, log_file: str | None, kwargs: dict[str, Any]) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(address)
        _send(s, {"python": sys.executable, "code": __file__, "path": sys.path, "cwd": os.getcwd(),
                  "env": dict(os.environ), "pid": os.getpid(), "target": target, "log": log_file,
                  "kwargs": kwargs}, fds=[0, 1, 2])
        reply = s.recv(1)
        if reply == b"R":
            raise _Refused
        try:  # the worker has started: from here on the job's outcome is the worker's
            status = s.recv(4)
        except ConnectionError:
            status = b""
        if reply != b"S" or len(status) != 4:
            print(f"quantstudy job server: the worker of {target} died before it finished; see {log_file}",
                  file=sys.stderr)
            return 1
        return struct.unpack("!i", status)[0]


def _send(s: socket.socket, obj: Any, fds: list[int] = ()) -> None:
    data = pickle.dumps(obj)
    socket.send_fds(s, [struct.pack("!Q", len(data))], list(fds))
    s.sendall(data)


def _receive(s: socket.socket) -> tuple[Any, list[int]]:
    header, fds, _, _ = socket.recv_fds(s, 8, 3)
    size, data = struct.unpack("!Q", header)[0], b""
    while len(data) < size:
        chunk = s.recv(size - len(data))
        if not chunk:
            raise ConnectionError("the job closed its connection")
        data += chunk
    return pickle.loads(data), fds


# --- the server -----------------------------------------------------------------------------

def start() -> subprocess.Popen | None:
    """Start a server for this Snakemake process and export its address to the jobs; None where
    fork is unavailable or the server did not start. GPU hosts too: once engines are compiled in
    `build`, a measurement job's imports (about 10 s on an H200 node) outweigh its opening and
    measuring (CUDA in forked workers is tested, tests/test_jobserver.py). Returns once the server
    serves (it has imported PRELOAD)."""
    if sys.platform != "linux":
        return None
    address = os.path.join(tempfile.mkdtemp(prefix="quantstudy-jobs-"), "socket")
    server = subprocess.Popen([sys.executable, "-m", "quantstudy.jobserver", address, str(os.getpid())],
                              stdin=subprocess.DEVNULL)
    while not os.path.exists(address):
        if server.poll() is not None:
            print("quantstudy job server did not start; jobs import their own libraries", file=sys.stderr)
            return None
        time.sleep(0.05)
    os.environ[ADDRESS] = address
    return server


def stop(server: subprocess.Popen | None) -> None:
    if server is None:
        return
    address = os.environ.pop(ADDRESS, None)
    server.terminate()
    server.wait()
    if address:
        with contextlib.suppress(OSError):
            os.unlink(address)
            os.rmdir(os.path.dirname(address))


def serve(address: str, owner: int) -> None:
    """Import PRELOAD, then fork one worker per job until the owner (Snakemake) exits."""
    os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")  # is_available() must not initialize CUDA
    import torch

    gpu = torch.cuda.is_available()  # NVML-based: does not initialize CUDA
    for module in PRELOAD:
        if not (gpu and module in INITIALIZE_CUDA):
            importlib.import_module(module)

    if torch.cuda.is_initialized():
        raise SystemExit("quantstudy job server: CUDA was initialized while importing; not serving")
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # workers are reaped by the kernel
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as listener:
        listener.bind(address + ".tmp")
        listener.listen(64)
        os.rename(address + ".tmp", address)  # the address appears only once it serves
        listener.settimeout(1.0)
        while os.getppid() == owner:
            try:
                conn, _ = listener.accept()
            except socket.timeout:
                continue
            if os.fork() == 0:
                listener.close()
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                signal.signal(signal.SIGTERM, signal.SIG_DFL)
                os._exit(_work(conn))
            conn.close()


def exit_on_sigterm(*_: Any) -> None:
    """The server's SIGTERM handler: exit, once. A run stopped from outside (a call's time limit) sends SIGTERM
    to the server twice, from its owner and from the limit; a second sys.exit inside the first exit's
    cleanup printed a traceback into Snakemake's log."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.exit(0)


def _work(conn: socket.socket) -> int:
    """In the forked worker: become the job, run it, report its exit status."""
    conn.settimeout(None)
    request, fds = _receive(conn)
    if (request["python"], request["code"]) != (sys.executable, __file__):  # another environment or checkout
        conn.sendall(b"R")
        return 0
    conn.sendall(b"S")
    for fd, std in zip(fds, (0, 1, 2)):
        os.dup2(fd, std)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    sys.path[:] = request["path"]
    _die_with(request["pid"])
    status = 0
    try:
        call(request["target"], request["log"], request["kwargs"])
    except SystemExit as e:
        status = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        status = 1
    usage = resource.getrusage(resource.RUSAGE_SELF)
    if request["log"]:
        with open(request["log"], "a") as f:
            f.write(f"job server worker: max RSS {usage.ru_maxrss / 1024:.0f} MiB, "
                    f"CPU {usage.ru_utime + usage.ru_stime:.1f} s\n")
    sys.stdout.flush()
    sys.stderr.flush()
    with contextlib.suppress(OSError):
        conn.sendall(struct.pack("!i", status))
    return status


def _die_with(pid: int) -> None:
    """A worker whose job was killed (Snakemake cancelled it) stops too."""
    def watch():
        while True:
            time.sleep(0.5)
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                os._exit(1)
    threading.Thread(target=watch, daemon=True).start()


if __name__ == "__main__":
    serve(sys.argv[1], int(sys.argv[2]))
