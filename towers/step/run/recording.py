"""The seat of a tower's pass traced alone to be cut (``cut.py``): what it
records where the towers meet.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import tensorflow as tf

from towers.step.rules.state import Form, form_of
from towers.step.run import seats


@dataclasses.dataclass
class Exchange:
    """One sum over the towers, as a traced tower's pass made it.

    Attributes:
      value: what the tower hands in (a tensor of the traced graph).
      result: the placeholder that stands for every tower's sum.
      backward: ``value`` is an upstream gradient (see ``seats.total``).
      phase: the phase whose ops read ``result``.
    """

    value: tf.Tensor
    result: tf.Tensor
    backward: bool
    phase: int = 0


@dataclasses.dataclass
class Once:
    """One action the towers meet for, run once with every tower's value (a
    model's own step's apply, assignment, metric update; a layer's moving
    statistics), as the pass made it.

    Attributes:
      value: what the tower hands in (tensors of the traced graph, and
        Python values as they are).
      action: ``action(handed)``, every tower's value in rank order.
      writes: the variables it changes; None: any (every op traced after it
        runs after it).
      made: the number of ops the graph held when it was met.
      phase: the phase it runs before.
    """

    value: Any
    action: Callable[[list], Any]
    writes: list[Any] | None
    made: int
    phase: int = 0


class Recording(seats.Alone):
    """The seat of a tower's pass traced alone to be cut: each sum over the
    towers becomes a placeholder, recorded as an :class:`Exchange`, each
    action run once a :class:`Once`; rows and code on one tower it cannot
    serve. ``meets``: the towers were sent to meet; else a sum is not served
    either (the runner then traces them one by one, whose steady steps beat
    the cut's: bench_divisor.py). ``own``: the pass is a model's own step,
    ``weight`` its tower's share (an input)."""

    def __init__(self, meets: bool, own: bool = False) -> None:
        self.exchanges: list[Exchange | Once] = []
        self.meets, self.own = meets, own
        self.graph: Any = None
        self.inputs: list[tf.Tensor] = []  # the tower's own: its rows, its share

    def everyone(self, value: Any) -> list[Any]:
        raise seats.Unserved("the towers' pass gathers rows")

    def from_first(self, compute: Callable[[], Any]) -> Any:
        raise seats.Unserved("the towers' pass runs code on one tower")

    # A tower's share weighs a backward sum as at a Seat (a model's own step).
    total = seats.Seat.total

    def _total(self, value: tf.Tensor, backward: bool) -> tf.Tensor:
        if not self.meets:
            raise seats.Unserved("the towers' pass meets at a sum")
        result = tf.raw_ops.Placeholder(
            dtype=value.dtype, shape=value.shape, name="towers_sum"
        )
        self.exchanges.append(Exchange(value, result, backward))
        return result

    def once(self, value: Any, action: Callable[[list], Any], writes=None) -> None:
        graph = tf.compat.v1.get_default_graph()
        if not self.meets or graph is not self.graph:
            raise seats.Unserved("the towers' pass meets inside a loop or branch")
        made = len(graph.get_operations())
        self.exchanges.append(Once(value, action, writes, made))

    def form(self, value: Any, marks: dict, forms: dict) -> Any:
        """``value``'s form as every tower's trace of this pass makes it: a
        tower's own inputs read are its rows; a captured tensor is named by
        what it captures."""
        captured = {id(inner): ("captured", id(outer))
                    for outer, inner in self.graph.captures}  # fmt: skip
        return Form(form_of(value, self.inputs, marks, captured, forms))
