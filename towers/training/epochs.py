"""Steps and epochs as Keras counts them, with a position a checkpoint saves.

Keras' ``EpochIterator`` rules (Keras 3.15, ``keras/src/trainers/epoch_iterator.py``),
over a :class:`towers.training.inputs.Source`:

- Without ``steps_per_epoch``, an epoch is one pass over the data, begun anew.
- With ``steps_per_epoch=N``, an epoch takes the next N batches of a pass that
  runs on across epochs; a new pass begins only when one runs out. A pass of
  known length that ends within an epoch ends that epoch early, with Keras'
  warning; so does input that runs out (a generator).
- The source's epoch hooks (a ``PyDataset``'s ``on_epoch_begin`` and
  ``on_epoch_end``) are called around each epoch.

What towers adds: the position (which pass, how many of its batches were read)
is saved with each checkpoint and a resumed run starts there
(:meth:`Epochs.resume`), rather than at the start of the epoch.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import keras
import tensorflow as tf

from towers._keras.inputs import warn_ran_out
from towers.training.inputs import Source


def limited(name: str, value: int | None) -> int | None:
    """``value`` (``"epochs"`` or ``"steps_per_epoch"``) under
    ``keras.config``'s limit for it, with Keras' warning when it cuts it, as
    Keras' fit and ``EpochIterator`` read them (None: no steps given).

    >>> limited("epochs", 5)  # no limit set
    5
    """
    limit = (
        keras.config.max_epochs() if name == "epochs"
        else keras.config.max_steps_per_epoch()
    )  # fmt: skip
    if limit and (not value or limit < value):
        warnings.warn(f"Limiting {name} to {limit}", stacklevel=3)
        return limit
    return value


class Epochs:
    """The batches of each epoch of one ``fit`` (or ``evaluate``, ``predict``).

    Args:
      source: the input.
      steps_per_epoch: batches per epoch; None: one pass.
      first_pass: the number of the first pass (its shuffle order).
      on_new_pass: called with each new pass's iterator (a checkpoint follows
        it, to save its position).

    Example:
      >>> from towers.training.inputs import source_of
      >>> epochs = Epochs(source_of(np.arange(5.0), batch_size=2), steps_per_epoch=2)
      >>> [[b.numpy().tolist() for _, b in epochs.epoch()] for _ in range(3)]
      [[[0.0, 1.0], [2.0, 3.0]], [[4.0]], [[0.0, 1.0], [2.0, 3.0]]]
    """

    def __init__(
        self,
        source: Source,
        steps_per_epoch: int | None = None,
        first_pass: int = 0,
        on_new_pass: Callable[[Any], None] = lambda iterator: None,
    ):
        self.source = source
        self.steps_per_epoch = steps_per_epoch
        self.num_batches = source.num_batches  # learned when a pass runs out
        self.pass_number = first_pass - 1
        self.read = 0  # batches read from the current pass
        self.yielded = False  # whether any pass has given a batch
        self.iterator: Iterator | None = None
        self.on_new_pass = on_new_pass

    @property
    def steps(self) -> int | None:
        """Steps in an epoch, as Keras' callbacks are told (None: unknown)."""
        return self.steps_per_epoch or self.num_batches

    @property
    def position(self) -> tuple[int, int]:
        """``(pass number, batches read from it)``, for a checkpoint."""
        return self.pass_number, self.read

    def open(self, number: int) -> Any:
        """Begins pass ``number``; returns its iterator (for a checkpoint to
        restore its position into)."""
        self.pass_number, self.read = number, 0
        self.iterator = iter(self.source.make_pass(number, 0))
        self.on_new_pass(self.iterator)
        return self.iterator

    def resume(self, number: int, read: int, positioned: bool) -> None:
        """Stands after the first ``read`` batches of pass ``number``: the
        opened pass's iterator already does when ``positioned`` (a checkpoint
        restored its position); a ``PyDataset`` starts at its batch index;
        otherwise the batches are read again and dropped."""
        if not positioned:
            if self.source.positioning == "index":
                self.iterator = iter(self.source.make_pass(number, read))
            else:
                if (self.iterator is None or self.pass_number != number
                        or self.read):  # fmt: skip
                    self.open(number)
                for _ in range(read):
                    next(self.iterator, None)
        self.pass_number, self.read = number, read
        self.yielded = self.yielded or bool(number or read)  # a run resumed

    def executions(
        self, first_step: int = 0, per_execution: int = 1
    ) -> Iterator[tuple[int, int, list[Any]]]:
        """One epoch in executions of ``per_execution`` steps, as Keras' fit
        counts them with ``steps_per_execution``: ``(begin, end, batches)``,
        ``end`` being ``begin + per_execution - 1`` (the batch hooks' index,
        a shorter last execution's too). With ``steps_per_epoch``, an epoch
        runs whole executions, as Keras' does (its last may pass the count).

        >>> from towers.training.inputs import source_of
        >>> epochs = Epochs(source_of(np.arange(5.0), batch_size=1))
        >>> [(b, e, len(batches)) for b, e, batches in epochs.executions(0, 2)]
        [(0, 1, 2), (2, 3, 2), (4, 5, 1)]
        """
        group: list[Any] = []
        begin = first_step
        for step, batch in self.epoch(first_step, multiple=per_execution):
            begin = step if not group else begin
            group.append(batch)
            if len(group) == per_execution:
                yield begin, begin + per_execution - 1, group
                group = []
        if group:
            yield begin, begin + per_execution - 1, group

    def epoch(
        self, first_step: int = 0, multiple: int = 1
    ) -> Iterator[tuple[int, Any]]:
        """One epoch's ``(step, batch)`` pairs, from ``first_step`` (a resumed
        epoch, standing where :meth:`resume` put it) on; with
        ``steps_per_epoch``, its steps rounded up to a ``multiple``."""
        self.source.epoch_begin()
        steps = self.steps or -1
        if self.steps_per_epoch and steps > 0:
            steps = -(-steps // multiple) * multiple
        if self.iterator is None or (first_step == 0 and self._pass_used()):
            self._next_pass()
        step = first_step
        while steps < 0 or step < steps:
            if self.num_batches and self.read >= self.num_batches:
                if self.steps_per_epoch:
                    warn_ran_out()
                break
            self.read += 1
            batch = self._next_batch()
            if batch is _END and not self.yielded:
                raise ValueError(  # a generator or filtered dataset of nothing
                    "x holds no examples: received input that yields no batch; "
                    "at least one is needed"
                )
            if batch is _END:  # ran out: an unknown length is now known
                if self.num_batches is None:
                    self.num_batches = self.read
                warn_ran_out()
                self._next_pass()
                self.source.epoch_end()
                return
            self.yielded = True
            yield step, batch
            step += 1
        if self._pass_used():
            if self.num_batches and self.read >= self.num_batches:
                # Read to its end: a tf.data shuffle that reshuffles each pass
                # draws its next pass's seed there, which the next pass's
                # iterator, made now, takes (and a checkpoint saves with it).
                next(self.iterator, None)
            self._next_pass()
        self.source.epoch_end()

    def _next_batch(self) -> Any:
        """The pass's next batch, or ``_END``; an error of Keras' class_weight
        mapping (a label it has no weight for) names class_weight."""
        try:
            return next(self.iterator, _END)
        except tf.errors.InvalidArgumentError as error:
            weights = self.source.class_weight
            if weights is None:
                raise
            said = re.search(r"indices\[\d+\] = -?\d+ is not in \[0, \d+\)", str(error))
            raise ValueError(
                f"class_weight has no weight for a label in batch {self.read} of "
                f"the pass: it weighs classes {sorted(weights)}, and Keras' "
                "mapping of a dataset's labels needs every label among them "
                f"({said.group(0) if said else error.message}). Nothing of "
                "that batch has trained."
            ) from error

    def _pass_used(self) -> bool:
        """Whether a new epoch needs a new pass: without ``steps_per_epoch``
        when the pass was read from (a resumed one standing at batch 0 is the
        epoch's), with it when the pass ran to its end."""
        if not self.steps_per_epoch:
            return self.read > 0
        return bool(self.num_batches) and self.read >= self.num_batches

    def _next_pass(self) -> None:
        self.open(self.pass_number + 1)


_END = object()
