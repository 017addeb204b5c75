"""Deadlines on one clock: every wait of the runtime ends within a bound counted on ``time.monotonic()``.

A wall clock (``time.time()``) steps when NTP or an operator sets it: a deadline counted on it can end
at once or hours late. Every waiting site of the runtime - a loop that asks again until something is
there, or a sleep woken early by an event - holds a :class:`Deadline` and, when it passes, says what it
waited for and for how long (:meth:`Deadline.timeout`, or an error of its own naming the bound).
``time.time()`` stays what it is for: timestamps read by other processes and hosts (heartbeats,
records, logs). ``tests/unit/test_clock.py`` checks that no module of the runtime sleeps or counts a
deadline any other way.

Worked example: a wait that polls, and one whose condition never comes:

>>> import itertools
>>> tries = itertools.count()
>>> wait_until(lambda: "there" if next(tries) == 3 else None, 5.0, "the third try", poll_s=0.001)
'there'
>>> wait_until(lambda: None, 0.02, "a reply that never comes", poll_s=0.005)
Traceback (most recent call last):
...
TimeoutError: a reply that never comes: not within 0.02 s

A loop of its own (it decides what a timeout means there):

>>> d = Deadline(0.02, "the pool's socket")
>>> while d.pause(0.005):  # True while time is left; sleeps at most until the deadline
...     pass
>>> d.expired(), d.left()
(True, 0.0)
>>> str(d.timeout("it exited"))
"the pool's socket: not within 0.02 s (it exited)"
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional, TypeVar

T = TypeVar("T")


class Deadline:
    """``seconds`` from now on the monotonic clock, for ``what`` (named in :meth:`timeout`). ``seconds``
    may be ``float("inf")``: a wait bounded elsewhere (said where it is made)."""

    __slots__ = ("seconds", "what", "end")

    def __init__(self, seconds: float, what: str = "the wait"):
        self.seconds, self.what = seconds, what
        self.end = time.monotonic() + seconds

    def left(self) -> float:
        """Seconds left (0 once passed)."""
        return max(0.0, self.end - time.monotonic())

    def expired(self) -> bool:
        return time.monotonic() >= self.end

    def pause(self, poll_s: float, wake: Optional[threading.Event] = None) -> bool:
        """Sleep ``poll_s``, less if the deadline comes first, or until ``wake`` is set; whether time is
        left afterwards (False: the deadline passed - or ``wake`` is set, which ends the wait too)."""
        s = min(poll_s, self.left())
        if wake is not None:
            if wake.wait(s):
                return False
        elif s > 0:
            time.sleep(s)
        return not self.expired()

    def timeout(self, detail: str = "") -> TimeoutError:
        """The error for a wait that ran out: what it waited for, the bound, and ``detail``."""
        return TimeoutError(f"{self.what}: not within {self.seconds:g} s" + (f" ({detail})" if detail else ""))


def wait_until(ready: Callable[[], Optional[T]], within_s: float, what: str, poll_s: float = 0.05,
               wake: Optional[threading.Event] = None) -> T:
    """The first value of ``ready()`` that is not None, asked at once and then every ``poll_s`` (or as
    soon as ``wake`` is set); :class:`TimeoutError` naming ``what`` after ``within_s`` seconds, or when
    ``wake`` is set without an answer. An exception of ``ready()`` ends the wait with it."""
    d = Deadline(within_s, what)
    while True:
        got = ready()
        if got is not None:
            return got
        if not d.pause(poll_s, wake):
            got = ready()  # one last look, at the deadline
            if got is not None:
                return got
            raise d.timeout("stopped" if wake is not None and wake.is_set() else "")


def pause(seconds: float) -> None:
    """A deliberate pause that waits for nothing (a back-off before asking again, a head start given
    to another process): the one plain sleep of the runtime."""
    if seconds > 0:
        time.sleep(seconds)
