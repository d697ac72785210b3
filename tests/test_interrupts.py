"""Ctrl-C and SIGTERM that a library swallows still end the run, at the end of the step they arrived in."""

import os
import signal
import time

import pytest

from logitless.recipes import interrupts


@pytest.fixture
def command():
    interrupts.begin_command()
    yield
    interrupts.begin_command()  # nothing pending for the next test
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)


def _swallowed(sent: signal.Signals) -> type[BaseException]:
    """Send ``sent`` to this process and catch what it raises, as a finalizer or a catch-all would."""
    try:
        os.kill(os.getpid(), sent)
        time.sleep(1.0)  # the handler runs in the main thread at the next bytecode
    except BaseException as caught:  # noqa: BLE001 - swallowing it is the point
        return type(caught)
    raise AssertionError(f"{sent.name} raised nothing")


@pytest.mark.parametrize("sent, raised", [(signal.SIGINT, KeyboardInterrupt), (signal.SIGTERM, interrupts.Terminated)])
def test_a_swallowed_interrupt_is_raised_again_when_the_step_ends(command, sent, raised):
    interrupts.step_done(1)  # nothing pending: the run goes on
    assert _swallowed(sent) is raised
    with pytest.raises(raised):
        interrupts.step_done(2)


def test_a_new_command_starts_with_no_interrupt_pending(command):
    _swallowed(signal.SIGINT)
    interrupts.begin_command()
    interrupts.step_done(1)
