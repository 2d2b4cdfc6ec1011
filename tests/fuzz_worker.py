"""Run ``edge run`` on model files in a worker process watched by the parent: the harness of
tests/test_model_validation.py and tests/test_fuzz_gguf.py.

The worker (``python -m tests.fuzz_worker``) reads one JSON case per line on stdin (the argv
of edge.cli.main), runs it in-process with stdout and stderr captured, and answers one JSON
line: the exit status, stderr, the classes of the exception the command ended with, the CPU
and wall seconds, and the case's peak RSS (VmHWM, reset before each case through
/proc/self/clear_refs). Keeping one process for many cases spares each case Python's start and
numba's cache load. The parent (:class:`Worker`) polls the worker's CPU time and RSS and
kills it when a case passes its CPU limit (a hang that spins), its wall limit (a hang that
waits; generous, as the machine may be busy) or the RSS ceiling, and sees a death by signal;
the next case then gets a fresh worker. :meth:`Result.problem` says what, if anything, broke
the contract for bad model files: exit 0, or exit 1 with one ``error:`` line from a GGUFError
(or a chat template's error, or the sampler's NaN check), never a signal, a traceback, a hang
or more than the memory budget.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CPU_BUDGET = 2.0         # seconds of CPU per case
MEMORY_BUDGET = 1 << 30  # bytes of peak RSS per case
ERRORS_ALLOWED = ("GGUFError", "ChatTemplateError", "SamplingError")   # what an "error:" line may come from


@dataclass
class Result:
    """What one case did. ``rc`` None: the worker died (``signal``), hung (``timed_out``), grew
    past the RSS ceiling (``over_memory``) or let an exception escape (``traceback``)."""

    rc: int | None = None
    stderr: str = ""
    error_types: list[str] = field(default_factory=list)
    traceback: str = ""
    cpu: float = 0.0
    wall: float = 0.0
    peak_rss: int = 0
    signal: int | None = None
    timed_out: bool = False
    over_memory: int = 0   # the RSS ceiling in bytes the worker was killed at, 0 if not

    @property
    def error_lines(self) -> list[str]:
        return [ln for ln in self.stderr.splitlines() if "error:" in ln]

    def problem(self, cpu_budget: float = CPU_BUDGET, memory_budget: int = MEMORY_BUDGET) -> str | None:
        """None when the case kept the contract (module docstring), else what broke it."""
        if self.signal is not None:
            return f"killed by signal {self.signal} ({signal.Signals(self.signal).name}): {self.stderr[-300:]!r}"
        if self.timed_out:
            return f"no answer after {self.cpu:.1f} s of CPU, {self.wall:.1f} s wall"
        if self.over_memory:
            return f"RSS passed {self.over_memory >> 20} MiB"
        if self.traceback:
            return f"traceback: {self.traceback[-600:]}"
        if self.rc not in (0, 1):
            return f"exit status {self.rc}: {self.stderr[-300:]!r}"
        if "Traceback" in self.stderr:
            return f"a traceback on stderr: {self.stderr[-600:]!r}"
        if self.rc == 1 and (len(self.error_lines) != 1 or not set(ERRORS_ALLOWED) & set(self.error_types)):
            return f"exit 1 from {self.error_types or 'no exception'} with stderr {self.stderr[-400:]!r}"
        if self.cpu > cpu_budget:
            return f"{self.cpu:.2f} s of CPU (budget {cpu_budget} s)"
        if self.peak_rss > memory_budget:
            return f"peak RSS {self.peak_rss >> 20} MiB (budget {memory_budget >> 20} MiB)"
        return None


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a process so far (/proc/PID/stat), 0 if it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _vm_kib(pid: int | str, field_name: str) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field_name + ":"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


class Worker:
    """The parent's handle on a worker process (started on first use, restarted after a death).

    Args:
        cpu_limit: CPU seconds a case may take before the worker is killed.
        wall_limit: wall seconds a case may take before the worker is killed.
        max_rss: bytes of RSS past which the worker is killed.
    """

    def __init__(self, cpu_limit: float = 5 * CPU_BUDGET, wall_limit: float = 120.0,
                 max_rss: int = 2 * MEMORY_BUDGET):
        self.cpu_limit, self.wall_limit, self.max_rss = cpu_limit, wall_limit, max_rss
        self.home = tempfile.mkdtemp(prefix="edge-fuzz-home-")
        self.proc: subprocess.Popen | None = None
        self._err = None
        self.started = 0

    def _start(self) -> None:
        self._err = tempfile.TemporaryFile()
        # PYTHONFAULTHANDLER: a death by signal leaves the Python stack in the stderr tail
        env = dict(os.environ, PYTHONPATH=str(ROOT), EDGE_HOME=self.home, PYTHONFAULTHANDLER="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.fuzz_worker"], cwd=ROOT, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err)
        self.started += 1

    def _stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
        self.proc = None

    def _stderr_tail(self) -> str:
        self._err.seek(0)
        return self._err.read()[-2000:].decode(errors="replace")

    def alive(self) -> bool:
        """True while a started worker runs (the next case pays no start-up)."""
        return self.proc is not None and self.proc.poll() is None

    def run(self, argv: list[str], cpu_limit: float | None = None) -> Result:
        """Run ``edge`` with ``argv`` in the worker; never raises for what the case does.
        ``cpu_limit`` overrides the worker's for this case (a warm-up that compiles)."""
        cpu_limit = self.cpu_limit if cpu_limit is None else cpu_limit
        wall_limit = max(self.wall_limit, 2 * cpu_limit)
        if not self.alive():
            self._start()
        t0, cpu0 = time.monotonic(), _cpu_seconds(self.proc.pid)
        self.proc.stdin.write((json.dumps(argv) + "\n").encode())
        self.proc.stdin.flush()
        out, buf = self.proc.stdout, b""
        while not buf.endswith(b"\n"):
            ready, _, _ = select.select([out], [], [], 0.05)
            wall = time.monotonic() - t0
            if ready:
                chunk = os.read(out.fileno(), 1 << 16)
                if not chunk:   # the worker died
                    self.proc.wait()
                    res = Result(signal=-self.proc.returncode if self.proc.returncode < 0 else None,
                                 rc=None if self.proc.returncode < 0 else self.proc.returncode,
                                 stderr=self._stderr_tail(), wall=wall)
                    self._stop()
                    return res
                buf += chunk
            elif wall > wall_limit or _cpu_seconds(self.proc.pid) - cpu0 > cpu_limit:
                cpu = _cpu_seconds(self.proc.pid) - cpu0
                self._stop()
                return Result(timed_out=True, wall=wall, cpu=cpu)
            elif _vm_kib(self.proc.pid, "VmRSS") * 1024 > self.max_rss:
                self._stop()
                return Result(over_memory=self.max_rss, wall=wall)
        return Result(**json.loads(buf))

    def close(self) -> None:
        """Stop the worker and remove its EDGE_HOME."""
        self._stop()
        shutil.rmtree(self.home, ignore_errors=True)


def _serve() -> None:
    """The worker's loop: one JSON argv per stdin line, one JSON Result per line on the
    original stdout (C-level writes to fd 1 go to stderr, so they cannot garble the answers)."""
    answers = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)
    from edge import cli
    from edge.cli import generate

    caught: list[BaseException] = []
    run = generate.cmd_run

    def traced_run(args):   # build_parser looks cmd_run up on each call, so this one is used
        try:
            return run(args)
        except BaseException as e:
            caught.append(e)
            raise

    generate.cmd_run = traced_run
    requests, sys.stdin = sys.stdin, open(os.devnull)    # `edge run` appends a piped stdin to its prompt
    for line in requests:
        argv = json.loads(line)
        caught.clear()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")   # reset VmHWM to the current RSS
        err = io.StringIO()
        res = Result()
        c0, t0 = time.process_time(), time.perf_counter()
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
                res.rc = cli.main(argv)
        except BaseException:   # what the user would see as a traceback
            res.traceback = traceback.format_exc()
        res.cpu, res.wall = time.process_time() - c0, time.perf_counter() - t0
        res.peak_rss = _vm_kib("self", "VmHWM") * 1024
        res.stderr = err.getvalue()
        if caught:
            res.error_types = [c.__name__ for c in type(caught[-1]).__mro__]
        answers.write(json.dumps(res.__dict__) + "\n")
        answers.flush()


if __name__ == "__main__":
    _serve()
