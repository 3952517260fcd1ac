"""RunningCalls.stop, a rank's side of on_timeout (runtime/reports.py), without processes: which
call it stops, and how (a task cancelled, a thread interrupted, a plain call left)."""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
import time

import pytest

import spmdcall as sc
from spmdcall.runtime.calls import CallRunner

pytestmark = pytest.mark.timeout(20)


class Spinner:
    def __init__(self) -> None:
        self.started = threading.Event()
        self.outcome = ""

    def spin(self, seconds):
        self.started.set()
        end = time.monotonic() + seconds
        try:
            while time.monotonic() < end:
                pass
        except sc.CallInterrupted:
            self.outcome = "interrupted"
            raise
        self.outcome = "finished"

    async def nap(self, seconds):
        self.started.set()
        await asyncio.sleep(seconds)


def _run_in_thread(runner: CallRunner, method: str, seconds: float) -> threading.Thread:
    def run() -> None:
        try:
            runner.run(None, method, (seconds,), {})
        except sc.CallInterrupted:
            pass

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    runner.instance.started.wait(5)
    return thread


def test_stop_interrupts_the_thread_running_a_plain_call():
    runner = CallRunner(Spinner())
    thread = _run_in_thread(runner, "spin", 10)
    assert runner.running.stop("spin", 60, interrupt=False) == "left"
    assert runner.running.stop("spin", 60, interrupt=True) == "interrupted"
    thread.join(5)
    assert not thread.is_alive() and runner.instance.outcome == "interrupted"
    assert runner.running.snapshot() == []


def test_stop_leaves_a_call_older_than_the_callers_and_a_method_not_asked_for():
    runner = CallRunner(Spinner())
    thread = _run_in_thread(runner, "spin", 0.6)
    time.sleep(0.2)
    assert runner.running.stop("spin", 0.1, interrupt=True) == ""  # started before the caller's call
    assert runner.running.stop("other", 60, interrupt=True) == ""
    thread.join(5)
    assert runner.instance.outcome == "finished"


def test_stop_cancels_an_async_calls_task():
    runner = CallRunner(Spinner())
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, daemon=True).start()
    try:
        future = asyncio.run_coroutine_threadsafe(runner.run_async(None, "nap", (60,), {}), loop)
        runner.instance.started.wait(5)
        assert runner.running.stop("nap", 60, interrupt=False) == "cancelled"
        with pytest.raises(concurrent.futures.CancelledError):
            future.result(5)
        assert runner.running.snapshot() == []
    finally:
        loop.call_soon_threadsafe(loop.stop)


def test_ranks_that_cannot_be_asked_get_why_as_their_note_and_no_stop():
    """The controller's side: a dead rank, or one whose reporter is not known yet, is not asked;
    its report says why and its stop is None, beside a rank that answers from its reporter."""
    import socket

    from spmdcall.runtime.reports import (
        ReportClient,
        RunningCalls,
        ask_all,
        reporters,
        serve_reports,
        stop_all,
    )

    class Rank:
        def __init__(self, died, reports):
            self.died, self.reports = died, reports

    ours, theirs = socket.socketpair()
    threading.Thread(target=serve_reports, args=(theirs, RunningCalls()), daemon=True).start()
    ranks = {
        0: Rank(None, ReportClient(ours)),
        1: Rank(sc.WorkerDiedError(1, None, "killed"), None),
        2: Rank(None, None),
    }
    clients = reporters(ranks)
    assert isinstance(clients[0], ReportClient) and isinstance(clients[1], str)
    reports = ask_all(clients, 2.0)
    assert sorted(reports) == [0, 1, 2] and "killed" in reports[1].note
    assert reports[2].note == "its reporter is not known yet" and reports[0].pid is not None
    assert stop_all(clients, 2.0, "spin", 10.0, False) == {0: "", 1: None, 2: None}
    ours.close()


def test_a_reporter_whose_controller_resets_the_connection_ends_quietly():
    """A controller gone mid-request (its end reset: TCP RST) ends the rank's reporter thread
    without an exception printed from it."""
    import socket
    import struct

    from spmdcall.runtime.reports import RunningCalls, serve_reports

    errors: list[BaseException] = []
    listener = socket.create_server(("127.0.0.1", 0))
    client = socket.create_connection(listener.getsockname())
    conn, _ = listener.accept()

    def serve() -> None:
        try:
            serve_reports(conn, RunningCalls())
        except BaseException as exc:  # what would reach threading.excepthook
            errors.append(exc)

    reporter = threading.Thread(target=serve, daemon=True)
    reporter.start()
    client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    client.sendall(b"\x00\x00")  # half a length prefix, then a reset
    client.close()
    reporter.join(5.0)
    listener.close()
    assert not reporter.is_alive() and errors == []
