"""towers/step/run/turns.py: towers traced in turns, meeting at a rendezvous."""

import threading
import time

import pytest

from towers.step.run.turns import Rendezvous, in_lockstep


def test_towers_trace_one_at_a_time_in_rank_order():
    # Tower 0 starts slowest: were the threads to trace at once, the others
    # would log first.
    meet, log = Rendezvous(3), []

    def work(rank):
        def traced():
            time.sleep(0.05 if rank == 0 else 0.0)
            log.append((rank, "forward"))
            seen = meet.exchange(rank, rank * 10)
            log.append((rank, "backward"))
            return seen

        return traced

    results = in_lockstep([work(r) for r in range(3)], meet)
    assert results == [[0, 10, 20]] * 3
    assert log == [(r, "forward") for r in range(3)] + [
        (r, "backward") for r in range(3)
    ]


def test_a_failing_tower_stops_the_others_with_its_error():
    meet = Rendezvous(3, timeout=60)

    def work(rank):
        def traced():
            meet.exchange(rank, rank)
            if rank == 1:
                raise ValueError("tower 1 cannot trace")
            return meet.exchange(rank, rank)

        return traced

    started = time.monotonic()
    with pytest.raises(ValueError, match="tower 1 cannot trace"):
        in_lockstep([work(r) for r in range(3)], meet)
    assert time.monotonic() - started < 30  # woken, not timed out


def test_towers_that_meet_a_different_number_of_times_fail_at_once():
    meet = Rendezvous(2, timeout=60)

    def work(rank):
        def traced():
            for _ in range(1 + rank):  # tower 1 meets twice, tower 0 once
                meet.exchange(rank, rank)

        return traced

    started = time.monotonic()
    with pytest.raises(threading.BrokenBarrierError, match="different number"):
        in_lockstep([work(r) for r in range(2)], meet)
    assert time.monotonic() - started < 30


def test_a_tower_that_never_hands_on_times_out():
    meet = Rendezvous(2, timeout=0.2)

    def work(rank):
        def traced():
            if rank == 0:
                time.sleep(1.0)  # holds its turn past the others' timeout
            return meet.exchange(rank, rank)

        return traced

    with pytest.raises(threading.BrokenBarrierError, match="tower 1 waited 0.2 s"):
        in_lockstep([work(r) for r in range(2)], meet)
