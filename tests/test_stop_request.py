"""``StopRequest`` in one process: a failure another thread finds ends the main thread's solo work with that
failure, never as a stop that nobody asked for."""

import signal
import threading
import time

import pytest

from ditrun.launch.stop import StopRequest


@pytest.fixture
def stop():
    request = StopRequest().install()
    yield request
    request.restore()


def test_a_failure_found_by_another_thread_ends_solo_work_with_it(stop):
    lost = RuntimeError("the store host stopped answering")
    timer = threading.Timer(0.2, stop.fail, args=(lost,))
    with pytest.raises(RuntimeError, match="stopped answering"):
        with stop.raising():
            timer.start()
            time.sleep(10)  # the failure's signal wakes the sleep
    timer.join(5)
    assert stop.signum is None


def test_the_failure_signal_arriving_after_its_block_ended_is_no_stop_request(stop):
    """The other thread signals while the main thread is inside the block; the main thread runs the handler only
    after it left the block (here: the signal held back until then)."""
    with stop.raising():
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
        stop.fail(RuntimeError("the store host stopped answering"))
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGUSR1})  # the handler runs now, outside the block
    assert stop.signum is None
    with pytest.raises(RuntimeError, match="stopped answering"):
        stop.check()


def test_another_ranks_node_fault_ends_solo_work_as_that_fault(stop):
    """A node fault of another rank reaches this one as its stop (the heartbeat's ``request`` and ``interrupt``):
    work alone ends at once with a ``NodeFault`` that says what the other rank said, exit status 1, and the
    supervisor gets it back from its pickle as it was."""
    import pickle

    from ditrun.launch.stop import FAULT, NodeFault

    def relayed():
        stop.request(FAULT, "rank 0 could not write (No space left on device: .../edits.jsonl)")
        stop.interrupt()

    timer = threading.Timer(0.2, relayed)
    with pytest.raises(NodeFault) as raised:
        with stop.raising():
            timer.start()
            time.sleep(10)  # the interrupt's signal wakes the sleep
    timer.join(5)
    fault = pickle.loads(pickle.dumps(raised.value))
    assert (fault.why, fault.found_here, fault.exit_code) == (
        "rank 0 could not write (No space left on device: .../edits.jsonl)",
        False,
        1,
    )


def test_a_rank_stopped_by_a_signal_is_seen_as_such_and_killed_at_once():
    """The supervisor's view of a frozen rank: SIGSTOP makes it suspended (it can act on no SIGTERM), SIGCONT not;
    ``_stop`` kills a suspended process rather than terminating it."""
    import multiprocessing
    import os

    from ditrun.launch.spawn import _stop, _suspended

    process = multiprocessing.get_context("fork").Process(target=time.sleep, args=(60,), daemon=True)
    process.start()
    try:
        assert not _suspended(process)
        os.kill(process.pid, signal.SIGSTOP)
        deadline = time.monotonic() + 10
        while not _suspended(process):
            assert time.monotonic() < deadline, "SIGSTOP never showed in /proc"
            time.sleep(0.01)
        _stop([process])
        assert process.exitcode == -signal.SIGKILL
        assert not _suspended(process)
    finally:
        if process.exitcode is None:
            process.kill()
            process.join(5)
