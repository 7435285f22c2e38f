"""The service as processes (`serve`): the supervisor, this process, holds the service's port, starts the engine
(the model on the device, the one queue), waits until it is ready, then starts the front-ends (HTTP and every
per-request job), each listening on that port (SO_REUSEPORT: the kernel spreads connections over them). It
watches them: a front-end that dies is started again; an engine that dies is started again (its front-ends have
answered its requests 503 at once, and reconnect). On SIGTERM the front-ends drain and finish their requests
within the grace time, then the engine stops, and the supervisor exits 0. It imports neither torch nor the web
stack: it only starts, watches and stops."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from smallstate_lm.errors import ConfigError

from ..lms import HF_PREFIX, is_hf
from .board import Board
from .settings import Settings

log = logging.getLogger("smallstate_lm.service")
POLL_S = 0.05  # how often the supervisor looks at its processes
KILL_MARGIN_S = 2.0  # past the grace time, what a process still running gets before SIGKILL
MAX_DELAY_S = 10.0  # the longest wait before an engine that keeps dying at start-up is started again
FAILED = "engine.failed"  # the engine's reason for refusing its model (engine/engine.py writes it)
SETTINGS = "settings.json"
BOARD = "board"


def available_cpus() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota where there is one."""
    try:
        cpus = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cpus = os.cpu_count() or 1
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        if quota != "max":
            cpus = min(cpus, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(1, cpus)


def default_frontends(cpus: int | None = None) -> int:
    """One front-end per CPU the service may use, less one for the engine; at least one (measured in
    docs/service.md, "Processes")."""
    return max(1, (cpus or available_cpus()) - 1)


def write_run(rundir: Path, settings: Settings, frontends: int) -> None:
    (rundir / SETTINGS).write_text(json.dumps({"settings": dataclasses.asdict(settings), "frontends": frontends}))


def read_run(rundir: str | Path) -> tuple[Settings, int, Board]:
    """What a process of the service starts from: the settings, the number of front-ends, and the board."""
    run = json.loads((Path(rundir) / SETTINGS).read_text())
    return Settings(**run["settings"]), run["frontends"], Board(Path(rundir) / BOARD, run["frontends"])


def setup_logging(settings: Settings) -> None:
    logger = logging.getLogger("smallstate_lm")
    if not logger.handlers:  # uvicorn configures its own loggers only
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("%(levelname)s:     %(message)s"))
        logger.addHandler(handler)
    logger.setLevel(logging.DEBUG if settings.log_level == "trace" else settings.log_level.upper())


def serve(settings: Settings) -> None:
    """Run the service until SIGTERM/SIGINT. SIGTERM: /readyz turns 503 for `drain_seconds`, then the listener
    closes, in-flight requests finish or get 503 within `graceful_timeout_s`, the engine releases the model and
    every process exits with status 0. A model that fails to load or its self-check: ConfigError (no request is
    ever served)."""
    setup_logging(settings)
    _check_files(settings)
    listener = _listen(settings)
    frontends = settings.frontends or default_frontends()
    rundir = Path(tempfile.mkdtemp(prefix="smallstate-"))
    try:
        (rundir / "metrics").mkdir()
        write_run(rundir, settings.replace(port=listener.getsockname()[1]), frontends)
        board = Board(rundir / BOARD, frontends, create=True)
        Supervisor(settings, rundir, board, listener, frontends).run()
    finally:
        listener.close()
        shutil.rmtree(rundir, ignore_errors=True)


def _check_files(settings: Settings) -> None:
    """A file the settings name that this process cannot read (a container's user may not own it), refused in one
    line before anything starts."""
    for key in ("lm", "ngram", "weights"):
        path = getattr(settings, key)
        if key == "lm" and is_hf(path):
            path = str(path)[len(HF_PREFIX):]
        if path is None or os.path.isdir(path):
            continue
        try:
            with open(path, "rb") as f:
                f.read(1)
        except OSError as e:
            raise ConfigError(f"--{key} {path}: cannot be read ({e.strerror or e})") from None


def listening_socket(host: str, port: int, listen: bool = True, reuse_port: bool = True) -> socket.socket:
    """A TCP socket on `host`:`port` in the port's SO_REUSEPORT group (unless not `reuse_port`): each front-end
    listens on one of its own, and the kernel spreads new connections over them (one shared socket would hand a
    burst of them all to whichever process woke first). ConfigError when the port is taken."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if reuse_port:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ConfigError(f"--port {port} on {host}: cannot listen there ({e.strerror or e})") from None
    if listen:
        sock.listen(2048)
    return sock


def _listen(settings: Settings) -> socket.socket:
    """The port held for the service's lifetime (bound, not listening: it takes no connections itself), so that it
    is known to be free before anything starts, and a port 0 becomes a real one for the front-ends. Probed first
    without SO_REUSEPORT: another service's front-ends on that port (which would share it with ours) hold it."""
    with listening_socket(settings.host, settings.port, listen=False, reuse_port=False) as probe:
        port = probe.getsockname()[1]
    return listening_socket(settings.host, port, listen=False)


class Supervisor:
    def __init__(self, settings: Settings, rundir: Path, board: Board, listener: socket.socket, frontends: int):
        self.s, self.rundir, self.board, self.listener = settings, rundir, board, listener
        self.n = frontends
        self.env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(rundir / "metrics")}
        self.engine: subprocess.Popen | None = None
        self.frontends: list[subprocess.Popen | None] = [None] * frontends
        self.signalled: int | None = None

    def run(self) -> None:
        previous = {sig: signal.signal(sig, self._signal) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            self.engine = self._start_engine()
            if not self._engine_ready():
                return
            for i in range(self.n):
                self.frontends[i] = self._start_frontend(i)
            log.info("serving on http://%s:%d: %d front-end(s) and the engine", self.s.host,
                     self.listener.getsockname()[1], self.n)
            self._watch()
        finally:
            self._stop()
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def _signal(self, sig, frame) -> None:
        self.signalled = sig

    # ---- starting ---------------------------------------------------------------------------------
    def _spawn(self, *args: str, **kw) -> subprocess.Popen:
        # the children leave ^C to the supervisor (a terminal sends it to the whole group)
        return subprocess.Popen([sys.executable, "-m", *args], env=self.env,
                                preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN), **kw)

    def _start_engine(self) -> subprocess.Popen:
        (self.rundir / FAILED).unlink(missing_ok=True)
        return self._spawn("smallstate_lm.service.engine", str(self.rundir))

    def _start_frontend(self, i: int) -> subprocess.Popen:
        return self._spawn("smallstate_lm.service.frontend", str(self.rundir), str(i))

    def _engine_ready(self) -> bool:
        """Wait for the first engine: True once ready; ConfigError when it refused its model; False on a signal."""
        while not self.board.engine_ready:
            code = self.engine.poll()
            if code is not None:
                failed = self.rundir / FAILED
                why = failed.read_text() if failed.exists() else f"the engine exited with status {code} (see the log)"
                raise ConfigError(f"the service refused to become ready: the model failed to load or its "
                                  f"self-check: {why}" if failed.exists() else f"the service did not start: {why}")
            if self.signalled is not None:
                return False
            time.sleep(POLL_S)
        return True

    # ---- watching ---------------------------------------------------------------------------------
    def _watch(self) -> None:
        failures = 0  # engines in a row that died before they were ready: each waits twice as long, up to MAX_DELAY_S
        while self.signalled is None:
            time.sleep(POLL_S)
            if self.board.engine_ready:
                failures = 0
            code = self.engine.poll()
            if code is not None and self.signalled is None:
                failed = self.rundir / FAILED
                why = f": the model failed to load or its self-check: {failed.read_text()}" if failed.exists() else ""
                delay = min(MAX_DELAY_S, self.s.restart_delay_s * 2**failures)
                log.error("the engine (pid %d) exited with status %s%s; starting it again in %.1f s", self.engine.pid,
                          code, why, delay)
                failures += 1
                self.board.engine(0, False)
                self._forget(self.engine.pid)
                time.sleep(delay)
                self.engine = self._start_engine()
            for i, proc in enumerate(self.frontends):
                code = proc.poll()
                if code is None or self.signalled is not None:
                    continue
                if code == 3:
                    raise ConfigError(f"front-end {i} refused to start (see the log above)")
                log.error("front-end %d (pid %d) exited with status %s; starting it again", i, proc.pid, code)
                self.board.frontend_ready(i, False)
                self.board.settle(i)
                self._forget(proc.pid)
                time.sleep(self.s.restart_delay_s)
                self.frontends[i] = self._start_frontend(i)

    def _forget(self, pid: int) -> None:
        """A dead process's live gauges leave the metrics (its counters stay: they counted what happened)."""
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid, str(self.rundir / "metrics"))

    # ---- stopping ---------------------------------------------------------------------------------
    def _stop(self) -> None:
        """Front-ends first (they drain, then answer what is in flight within the grace time), then the engine."""
        grace = self.s.drain_seconds + self.s.graceful_timeout_s + KILL_MARGIN_S
        live = [p for p in self.frontends if p is not None and p.poll() is None]
        _terminate(live, grace)
        if self.engine is not None:
            _terminate([self.engine], self.s.graceful_timeout_s + KILL_MARGIN_S)


def _terminate(procs: list[subprocess.Popen], within: float) -> None:
    """SIGTERM to each of `procs`, SIGKILL to any still running `within` seconds later."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    end = time.monotonic() + within
    for p in procs:
        try:
            p.wait(max(0.0, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.error("process %d did not stop within %.0f s: killed", p.pid, within)
            p.kill()
            p.wait()
