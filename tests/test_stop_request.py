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
