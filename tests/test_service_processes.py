"""The service as processes, end to end (`smallstate-lm serve` with real processes on loopback): a front-end
killed under load is replaced while the others serve; an engine killed under load answers every request in it
503 at once and serves again after the model is loaded again; /metrics adds up every process."""

from __future__ import annotations

import os
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
from test_server import Server, _metric, post, utt
from test_service_abuse import wait_until


def _load(srv: Server, stop: threading.Event, codes: list) -> None:
    """Small requests one after another until `stop`: each status, or the transport error's name."""
    with httpx.Client(base_url=srv.url, timeout=30) as client:
        while not stop.is_set():
            try:
                codes.append(client.post("/rescore", json={"utterances": [utt()]}).status_code)
            except httpx.TransportError as e:  # a connection the killed front-end held
                codes.append(type(e).__name__)


def test_a_killed_front_end_is_replaced_while_the_others_serve(tiny_lm_dir, kenlm_model, tmp_path):
    srv = Server(tiny_lm_dir, kenlm_model, "frontends=2", "drain_seconds=0", log=tmp_path / "server.log")
    try:
        first, second = srv.frontend_pids()
        stop, codes = threading.Event(), []
        loaders = [threading.Thread(target=_load, args=(srv, stop, codes)) for _ in range(4)]
        for t in loaders:
            t.start()
        wait_until(lambda: codes.count(200) >= 20, what="requests served before the kill")
        os.kill(first, signal.SIGKILL)
        killed = time.monotonic()
        served_before = codes.count(200)
        wait_until(lambda: codes.count(200) >= served_before + 20, timeout=10, what="the other front-end serving")
        wait_until(lambda: len(srv.frontend_pids()) == 2 and first not in srv.frontend_pids(), timeout=5,
                   what="the killed front-end replaced")
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, timeout=10, what="ready again")
        back = time.monotonic() - killed
        stop.set()
        for t in loaders:
            t.join()
        assert second in srv.frontend_pids()
        assert back < 5 + 10, back  # replaced within 5 s (above); ready once its models are loaded
        # only the connections the killed front-end held failed (transport errors); no request got an error status
        assert all(c == 200 or isinstance(c, str) for c in codes), set(codes)
    finally:
        assert srv.stop() == 0, srv.log.read_text()
    assert "starting it again" in srv.log.read_text()


def test_a_killed_engine_answers_its_requests_503_at_once_and_serves_again(tiny_lm_dir, kenlm_model, tmp_path):
    # a fixed 2 s batching wait keeps the requests in the engine when it is killed
    srv = Server(tiny_lm_dir, kenlm_model, "max_wait_ms=2000", "wait_for_arrivals=false", "drain_seconds=0",
                 log=tmp_path / "server.log")
    try:
        engine = srv.engine_pid()
        with ThreadPoolExecutor(6) as ex:
            def one(_):
                r = post(srv, "/rescore", {"utterances": [utt()]})
                return r, time.monotonic()

            futures = [ex.submit(one, i) for i in range(6)]
            wait_until(lambda: _metric(httpx.get(srv.url + "/metrics").text, "smallstate_queue_depth") >= 6,
                       timeout=10, what="six requests queued in the engine")
            os.kill(engine, signal.SIGKILL)
            killed = time.monotonic()
            answers = [f.result(timeout=30) for f in futures]
        for r, t in answers:
            assert r.status_code == 503, r.text
            assert r.headers["retry-after"] and "engine" in r.json()["detail"], r.text
            assert t - killed < 1.0, f"answered {t - killed:.2f} s after the kill"
        wait_until(lambda: httpx.get(srv.url + "/readyz").status_code == 200, timeout=60, what="a new engine")
        assert srv.engine_pid() != engine
        assert post(srv, "/rescore", {"utterances": [utt()]}).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_metrics_add_up_every_process(tiny_lm_dir, kenlm_model, tmp_path):
    srv = Server(tiny_lm_dir, kenlm_model, "frontends=2", "drain_seconds=0", log=tmp_path / "server.log")
    try:
        with ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(lambda _: post(srv, "/rescore", {"utterances": [utt()]}).status_code, range(40)))
        assert codes == [200] * 40
        for _ in range(4):  # whichever front-end answers, the same totals
            text = httpx.get(srv.url + "/metrics").text
            assert _metric(text, "smallstate_requests_total", route="/rescore", method="POST", status="200") == 40
            assert _metric(text, "smallstate_batch_requests_count") >= 1  # counted by the engine
            assert _metric(text, "smallstate_ready") == 1
    finally:
        assert srv.stop() == 0, srv.log.read_text()


def test_a_second_service_on_the_same_port_is_refused(kenlm_model, tmp_path):
    """Front-ends share their port by SO_REUSEPORT: a second service must not join them unseen."""
    import subprocess
    import sys

    from conftest import REPO

    srv = Server(None, kenlm_model, "drain_seconds=0", log=tmp_path / "server.log")
    try:
        second = subprocess.run([sys.executable, "-m", "smallstate_lm.cli", "serve", "--ngram", str(kenlm_model),
                                 "--port", str(srv.port), "--device", "cpu"], capture_output=True, text=True,
                                timeout=120, cwd=REPO)
        assert second.returncode != 0 and "Traceback" not in second.stderr, second.stderr
        assert f"--port {srv.port}" in second.stderr and "cannot listen there" in second.stderr, second.stderr
        assert post(srv, "/score", {"sentences": ["the lord"]}).status_code == 200
    finally:
        assert srv.stop() == 0, srv.log.read_text()
