"""A ``--join`` node asks again when the router is failing over or another change
went first, and so does its graceful leave on SIGTERM (node/server.py).

The router's answers are scripted by a small HTTP server on 127.0.0.1 standing in
for the admin API (the answers a leader election or a concurrent change gives:
409 ``ring_changed``, 503 ``no_leader``), because a real router gives them only in
a race; the node is a real process.
"""

from __future__ import annotations

import http.server
import json
import signal
import threading
import time

import pytest

from node.server import JOIN_NOT_READY_ATTEMPTS
from tests.processes import Procs, free_port, wait_for

pytestmark = pytest.mark.integration


class ScriptedRouter:
    """Answers POST/DELETE /admin/nodes... from a script; records what it was asked."""

    def __init__(self, answers: dict[str, list[tuple[int, dict[str, str]]]]) -> None:
        self.answers = answers
        self.asked: list[str] = []
        scripted = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def _answer(self) -> None:
                length = int(self.headers.get("content-length") or 0)
                self.rfile.read(length)
                scripted.asked.append(self.command)
                queue = scripted.answers.get(self.command, [])
                status, body = queue.pop(0) if len(queue) > 1 else queue[0]
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            do_POST = do_DELETE = _answer

            def log_message(self, format: str, *args: object) -> None:
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    def __enter__(self) -> ScriptedRouter:
        self.thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(5)


CHANGED = (409, {"error": "ring_changed", "detail": "another router changed the ring first"})
NO_LEADER = (503, {"error": "no_leader", "detail": "no router leads the ring right now"})
TAKEN = (409, {"error": "already_member", "detail": "node n1 is in the ring with another url"})
#: A router's answer to a join or a leave: its ring (a join's lists the node).
OK = (200, {"epoch": 2, "nodes": [{"id": "n1", "url": "http://127.0.0.1:1", "weight": 1}]})


def test_join_and_leave_retry_a_failover_and_a_concurrent_change(procs: Procs) -> None:
    script = {"POST": [CHANGED, NO_LEADER, OK], "DELETE": [NO_LEADER, CHANGED, OK]}
    with ScriptedRouter(script) as router:
        proc, _ = procs.node("n1", free_port(), "--join", router.url)
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        assert router.asked == ["POST"] * 3
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        assert router.asked == ["POST"] * 3 + ["DELETE"] * 3
        assert f"left the ring: router {router.url} answered 200" in proc.output(), proc.output()


def test_join_and_leave_go_through_whichever_router_answers(procs: Procs) -> None:
    """``--join A,B`` (the routers of one cluster on etcd): with A down, the node
    joins through B, and its graceful leave goes through B too (it used to retry
    the one router it knew, then exit without a leave): tried at B first, the
    router that took the join, then, B failing over, at A, then at B again."""
    down = f"http://127.0.0.1:{free_port()}"
    with ScriptedRouter({"POST": [OK], "DELETE": [NO_LEADER, OK]}) as router:
        proc, _ = procs.node("n1", free_port(), "--join", f"{down},{router.url}")
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        assert f"joined the ring through {router.url}" in proc.output()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        assert router.asked == ["POST", "DELETE", "DELETE"]
        output = proc.output()
        assert f"graceful leave: router {down}: ConnectError; retrying" in output, output
        assert f"left the ring: router {router.url} answered 200" in output, output


def test_a_final_refusal_is_not_retried(procs: Procs) -> None:
    with ScriptedRouter({"POST": [TAKEN]}) as router:
        proc = procs.start(
            "n1", ["node", "--id", "n1", "--port", str(free_port()), "--join", router.url]
        )
        assert proc.popen.wait(30) == 1
        assert router.asked == ["POST"]
        assert f"giving up: router {router.url} answered 409" in proc.output()
        # Its code and detail, whole (an excerpt of the JSON cut a refusal's fix).
        assert "409: already_member: node n1 is in the ring with another url" in proc.output()


def test_a_join_at_a_web_server_is_one_line_in_the_log(procs: Procs) -> None:
    """``--join`` at a plain web server (it answers POST with an HTML page, 501):
    the log line quoted the page whole, about ten lines (an exploratory tester)."""

    class Quiet(http.server.BaseHTTPRequestHandler):  # no do_POST: 501, an HTML page
        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Quiet)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{server.server_address[1]}"
    try:
        argv = ["node", "--id", "n1", "--port", str(free_port()), "--join", url]
        proc = procs.start("n1", [*argv, "--join-timeout", "3"])
        assert proc.popen.wait(30) == 1
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)
    lines = [line for line in proc.output().splitlines() if line.strip()]
    said = [line for line in lines if f"router {url} answered 501: <!DOCTYPE HTML>" in line]
    assert len(said) == 1 and "Error response" in said[0], lines
    assert not [line for line in lines if line.lstrip().startswith("<")], lines


#: A leave refused as the ring's last node's: what a new leader answers when a
#: router of the version before passed the node's leave on without ``?force=true``.
LAST_NODE = (409, {"error": "last_node", "detail": "node 'n1' is the ring's last node"})


def test_a_refused_leave_is_not_logged_as_a_leave(procs: Procs) -> None:
    """A final refusal of the leave (409 ``last_node``, from a leader reached
    through an earlier version's router that dropped ``?force=true``) is said
    to be one, with the router's answer: the node used to log "left the ring:
    router answered 409" while the ring kept it."""
    with ScriptedRouter({"POST": [OK], "DELETE": [LAST_NODE]}) as router:
        proc, _ = procs.node("n1", free_port(), "--join", router.url)
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        assert router.asked == ["POST", "DELETE"]
        output = proc.output()
        assert "left the ring" not in output, output
        assert f"graceful leave refused (router {router.url} answered 409: " in output, output
        assert "last_node" in output, output


#: What a router answers a join whose URL it cannot reach (router/membership.py:
#: the readiness wait ran out): a 504 ``not_ready`` JSON body.
NOT_READY = (
    504,
    {"error": "not_ready", "detail": "node n1 at http://x did not answer /healthz within 10s"},
)


@pytest.mark.reliability
def test_a_mistyped_url_gives_up_after_a_bounded_number_of_attempts(procs: Procs) -> None:
    """A ``--join`` node whose ``--url`` is wrong (here a port nobody listens
    on): every join is answered 504 ``not_ready``. The node stops after
    JOIN_NOT_READY_ATTEMPTS of them, exits 1 and says, in one line, which URL
    the router could not reach and what to check; it does not retry for minutes."""
    wrong = f"http://127.0.0.1:{free_port()}"
    with ScriptedRouter({"POST": [NOT_READY]}) as router:
        started = time.monotonic()
        argv = ["node", "--id", "n1", "--port", str(free_port()), "--join", router.url]
        proc = procs.start("n1", [*argv, "--url", wrong])
        status = proc.popen.wait(30)
        took = time.monotonic() - started
        output = proc.output()
    print(f"\n[mistyped --url] exit {status} after {took:.2f}s, {len(router.asked)} join attempts")
    assert status == 1, output
    assert router.asked == ["POST"] * JOIN_NOT_READY_ATTEMPTS
    given_up = [line for line in output.splitlines() if "could not join the ring" in line]
    assert len(given_up) == 1, output
    assert (
        f"giving up: the router at {router.url} could not reach this node at {wrong} "
        "(check --url / --host" in given_up[0]
    ), output
    # Start (a Python process: 1-4 s on a loaded machine), then 3 answers with
    # 0.1 s and 0.2 s between them: far below the 120 s join deadline.
    assert took <= 15.0, took


def test_a_leave_does_not_spend_its_time_on_a_router_that_never_answers(procs: Procs) -> None:
    """A router takes the connection and never answers (a hung process): the leave
    gives it half the time left of its 20 s, then goes back to the other router
    (an attempt used to wait up to 60 s, past the deadline and a kill grace)."""
    import socket

    with socket.socket() as hung, ScriptedRouter({"POST": [OK], "DELETE": [OK]}) as router:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # connections complete in the kernel; nobody reads them
        silent = f"http://127.0.0.1:{hung.getsockname()[1]}"
        proc, _ = procs.node("n1", free_port(), "--join", f"{router.url},{silent}")
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        router.asked.clear()
        # The scripted router answers first with a failover's 503, so the hung
        # one is asked next; the scripted one then takes the leave.
        router.answers["DELETE"] = [NO_LEADER, OK]
        started = time.monotonic()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        took = time.monotonic() - started
    output = proc.output()
    print(f"\n[leave past a hung router] {took:.1f} s")
    assert router.asked == ["DELETE", "DELETE"], (router.asked, output)
    assert f"left the ring: router {router.url} answered 200" in output, output
    assert took < 19.0, took


def test_a_join_does_not_spend_its_time_on_a_router_that_never_answers(procs: Procs) -> None:
    """``--join HUNG,OK --join-timeout 8``: the hung router (a paused process)
    gets half the time left, then the other one takes the join. Before, it got
    all of it, and the node gave up without trying the healthy router (an
    exploratory tester, three routers on etcd and the first one paused)."""
    import socket

    with socket.socket() as hung, ScriptedRouter({"POST": [OK], "DELETE": [OK]}) as router:
        hung.bind(("127.0.0.1", 0))
        hung.listen(8)  # connections complete in the kernel; nobody reads them
        silent = f"http://127.0.0.1:{hung.getsockname()[1]}"
        started = time.monotonic()
        proc, _ = procs.node(
            "n1", free_port(), "--join", f"{silent},{router.url}", "--join-timeout", "8"
        )
        joined = f"joined the ring through {router.url}"
        assert wait_for(lambda: joined in proc.output() or proc.popen.poll() is not None, 20.0)
        took = time.monotonic() - started
        assert joined in proc.output(), proc.output()
        assert router.asked == ["POST"]
        # The leave starts at the router that took the join.
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        assert router.asked == ["POST", "DELETE"]
        assert f"graceful leave: router {silent}" not in proc.output(), proc.output()
    print(f"\n[join past a hung router] {took:.1f} s")


def test_a_second_signal_during_the_leave_exits_without_a_traceback(procs: Procs) -> None:
    """A second SIGTERM (or Ctrl-C) while the node leaves forces the exit: uvicorn
    then skips the application's shutdown, and the end of the loop cancelled it:
    a CancelledError traceback in the log on every double Ctrl-C, its tasks and
    clients never closed (an exploratory tester). The leave still ends first."""
    with ScriptedRouter({"POST": [OK], "DELETE": [OK]}) as router:
        proc, _ = procs.node("n1", free_port(), "--join", router.url)
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        proc.popen.send_signal(signal.SIGTERM)
        time.sleep(0.05)
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        output = proc.output()
        assert "left the ring" in output, output
        assert "Traceback" not in output and "CancelledError" not in output, output


STILL_JOINING = (409, {"error": "still_joining", "detail": "node n1 is still joining"})


def test_a_leave_answered_still_joining_is_not_in_the_ring(procs: Procs) -> None:
    """A node stopped between the router's welcome and its join's commit: the
    router answers its leave 409 ``still_joining`` (it said 404 before), and the
    node exits as not in the ring, not with "the ring keeps this node" (the
    review of the day's changes)."""
    with ScriptedRouter({"POST": [OK], "DELETE": [STILL_JOINING]}) as router:
        proc, _ = procs.node("n1", free_port(), "--join", router.url)
        assert wait_for(lambda: "joined the ring" in proc.output(), 20.0), proc.output()
        proc.popen.send_signal(signal.SIGTERM)
        assert proc.popen.wait(30) == 0
        output = proc.output()
        assert "not in the ring" in output and "graceful leave refused" not in output, output
