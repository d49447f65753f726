"""``python -m jdist.launch``: run one script as N local workers of a multi-worker job.

Each worker is a child process with its own ``TF_CONFIG`` (loopback ports) and output prefixed
with ``[worker i]``. When one fails, or the launcher is interrupted, the others are ended by
PID; on Linux the children get SIGKILL if the launcher dies, so none is left behind.
``--max-restarts`` starts a failed job again (``JDIST_RESTART`` says which start; the script
resumes from its checkpoint, ``docs/stop_and_resume.md``).
"""

import argparse
import ctypes
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence

_GRACE_SECONDS = 5.0
_PR_SET_PDEATHSIG = 1
# Printed once per local device when gloo's collectives connect; kept when the counts differ.
_GLOO_CONNECTED = re.compile(rb"\[Gloo\] Rank \d+ is connected to (\d+) peer ranks\. "
                             rb"Expected number of connected peer ranks is : \1\n?")


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """The launcher's options, the script and the script's arguments."""
    parser = argparse.ArgumentParser(
        prog="python -m jdist.launch",
        description="Run a script as N local workers of a MultiWorkerMirroredStrategy job.")
    parser.add_argument("--nproc", type=int, required=True, help="number of worker processes")
    parser.add_argument("--devices-per-proc", type=int, default=None,
                        help="simulated CPU devices per worker (XLA_FLAGS); default: real devices")
    parser.add_argument("--max-restarts", type=int, default=0,
                        help="start the job again, up to this many times, after a worker fails")
    parser.add_argument("--restart-nproc", type=int, default=None,
                        help="number of worker processes of every restart (the job resumes from "
                        "its checkpoint on them); default: --nproc")
    parser.add_argument("script", help="the Python script every worker runs")
    parser.add_argument("args", nargs=argparse.REMAINDER, help="arguments of the script")
    args = parser.parse_args(argv)
    if args.nproc < 1 or (args.restart_nproc is not None and args.restart_nproc < 1):
        parser.error("--nproc and --restart-nproc must be at least 1")
    if args.max_restarts < 0:
        parser.error("--max-restarts must be at least 0")
    if args.devices_per_proc is not None and args.devices_per_proc < 1:
        parser.error("--devices-per-proc must be at least 1")
    return args


def free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 (the sockets are closed before returning)."""
    sockets = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            sockets.append(s)
        return [s.getsockname()[1] for s in sockets]
    finally:
        for s in sockets:
            s.close()


def worker_env(base: dict, ports: Sequence[int], index: int,
               devices_per_proc: Optional[int] = None) -> dict:
    """The environment of worker ``index``: ``TF_CONFIG`` and, if asked, simulated devices."""
    env = dict(base)
    env["TF_CONFIG"] = json.dumps({
        "cluster": {"worker": [f"127.0.0.1:{p}" for p in ports]},
        "task": {"type": "worker", "index": index}})
    env["PYTHONUNBUFFERED"] = "1"
    if devices_per_proc is not None:
        flags = [f for f in env.get("XLA_FLAGS", "").split()
                 if not f.startswith("--xla_force_host_platform_device_count")]
        flags.append(f"--xla_force_host_platform_device_count={devices_per_proc}")
        env["XLA_FLAGS"] = " ".join(flags)
    return env


def _die_with_parent():
    """Runs in the child before exec: SIGKILL it when the launcher dies (Linux)."""
    try:
        ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except (AttributeError, OSError):
        pass  # Not Linux: the launcher's own handlers still end the workers.


def _pump(stream, index, out):
    """Copies ``stream`` to ``out`` line by line, prefixed with the worker index.

    Drops gloo's "Rank i is connected" messages. gloo prints each in several pieces, from one
    thread per local device, so a message can land inside another line: inside the script's
    output or inside another device's message. When removing one takes a line's newline with it,
    the rest of that line waits for the next one (``carry``), which holds its continuation.
    """
    prefix = f"[worker {index}] ".encode()
    carry = b""
    for line in iter(stream.readline, b""):
        line, dropped = _GLOO_CONNECTED.subn(b"", carry + line)
        carry = b""
        if dropped and not line.endswith(b"\n"):
            carry = line
        elif line.strip() or not dropped:
            out.buffer.write(prefix + line if line.endswith(b"\n") else prefix + line + b"\n")
            out.flush()
    if carry:
        out.buffer.write(prefix + carry + b"\n")
        out.flush()
    stream.close()


class Workers:
    """The started worker processes and the threads copying their output."""

    def __init__(self, command: list[str], envs: Sequence[dict]):
        self.procs, self.threads = [], []
        for i, env in enumerate(envs):
            proc = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, preexec_fn=_die_with_parent)
            self.procs.append(proc)
            for stream, out in ((proc.stdout, sys.stdout), (proc.stderr, sys.stderr)):
                thread = threading.Thread(target=_pump, args=(stream, i, out), daemon=True,
                                          name=f"jdist-launch-{i}")
                thread.start()
                self.threads.append(thread)

    def wait(self) -> int:
        """Waits until all succeed (returns 0) or one fails (returns its status)."""
        while True:
            codes = [p.poll() for p in self.procs]
            failed = [c for c in codes if c not in (None, 0)]
            if failed:
                return _exit_status(failed[0])
            if all(c == 0 for c in codes):
                return 0
            time.sleep(0.05)

    def stop(self) -> None:
        """Terminates the workers still running (SIGTERM, then SIGKILL) and joins everything."""
        for p in self.procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + _GRACE_SECONDS
        for p in self.procs:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
        for thread in self.threads:
            thread.join()


def _exit_status(code):
    return 128 - code if code < 0 else code  # Killed by signal s: the shell's 128 + s.


def _raise_on_sigterm(signum, frame):
    raise KeyboardInterrupt


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the launcher; returns its exit status.

    Args:
      argv: the command line after ``python -m jdist.launch`` (default ``sys.argv[1:]``).

    Returns:
      0 when every worker succeeded (in the last start, with ``--max-restarts``), else the
      first failed worker's status (130 when the launcher was interrupted).
    """
    args = parse_args(sys.argv[1:] if argv is None else argv)
    previous = signal.signal(signal.SIGTERM, _raise_on_sigterm)
    try:
        for attempt in range(args.max_restarts + 1):
            status = _run_once(args, attempt)
            if not status or attempt == args.max_restarts:
                break
            sys.stderr.write(f"jdist.launch: starting the job again ({attempt + 1} of "
                             f"{args.max_restarts} restarts, {args.restart_nproc or args.nproc} "
                             "workers).\n")
        return status
    except KeyboardInterrupt:
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


def _run_once(args, attempt):
    """Starts every worker, waits, ends those still running; returns the job's status."""
    nproc = args.nproc if attempt == 0 or args.restart_nproc is None else args.restart_nproc
    ports = free_ports(nproc)
    base = dict(os.environ, JDIST_RESTART=str(attempt))
    envs = [worker_env(base, ports, i, args.devices_per_proc) for i in range(nproc)]
    workers = None
    try:
        workers = Workers([sys.executable, "-u", args.script] + args.args, envs)
        status = workers.wait()
        if status:
            sys.stderr.write(f"jdist.launch: a worker exited with status {status}; stopping "
                             "the others.\n")
        return status
    finally:
        if workers is not None:
            workers.stop()
