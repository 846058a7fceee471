"""The update: one optimizer apply per step (or per k micro-batches), or none.

After the combine, a step's update is all or nothing: the optimizer's apply (which
also advances its iteration count) and the BatchNormalization moving statistics
run together, or, when the policy says to skip, neither does.

- ``on_nonfinite``: ``"ignore"`` applies whatever the gradients are (Keras'
  behaviour, no check); ``"skip"`` and ``"raise"`` check every combined gradient and
  apply nothing if one is inf or NaN (``"raise"`` then names it).
- Loss scaling: under a ``mixed_float16`` policy the optimizer is wrapped in a
  ``keras.optimizers.LossScaleOptimizer`` (:func:`make_optimizer`, as Keras'
  ``compile`` does); each tower's loss is multiplied by the scale; the optimizer
  unscales the combined gradient once, applies or skips, and adjusts the scale.
- ``accumulate_steps=k``: each step adds its combined gradient, weighted by its
  examples, to accumulators on the variable device; every k-th step applies their
  weighted mean. That is exactly one step on the k batches together, uneven
  sizes included, with one optimizer iteration per apply.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, Literal

import keras
import numpy as np
import tensorflow as tf

from towers.placement.accumulate import Accumulator

NonfinitePolicy = Literal["ignore", "raise", "skip"]
NONFINITE_POLICIES = ("ignore", "raise", "skip")


def needs_loss_scaling(model: keras.Model) -> bool:
    """Whether ``model`` computes in float16, whose gradients need loss scaling
    (``mixed_bfloat16`` does not: bfloat16 has float32's range)."""
    return model.dtype_policy.name == "mixed_float16"


def make_optimizer(
    optimizer: Any, device: str, loss_scaling: bool = False
) -> keras.optimizers.Optimizer | None:
    """The optimizer an engine applies with (None: an engine that only
    predicts, its model not compiled).

    Args:
      optimizer: a Keras optimizer, its name (``"adam"``, with Keras' defaults),
        or a zero-arg function that makes one (made under ``device``, so the
        scalars Keras makes with it live there); or None.
      device: the device the optimizer is made on.
      loss_scaling: wrap it in a ``LossScaleOptimizer`` unless it is one already
        (for a ``mixed_float16`` model: float16 gradients underflow without it).

    Raises:
      ValueError: ``optimizer`` is none of these.

    Example:
      >>> opt = make_optimizer(keras.optimizers.SGD, "/cpu:0", loss_scaling=True)
      >>> type(opt).__name__, type(opt.inner_optimizer).__name__
      ('LossScaleOptimizer', 'SGD')
    """
    given = optimizer
    if isinstance(optimizer, str):  # a name, as Keras' compile takes it ("adam")
        with tf.device(device):
            try:
                optimizer = keras.optimizers.get(optimizer)
            except ValueError:
                optimizer = None
    elif not isinstance(optimizer, keras.optimizers.Optimizer) and callable(optimizer):
        with tf.device(device):
            optimizer = optimizer()
    if optimizer is None and not isinstance(given, str):
        return None  # none given (an uncompiled model's): nothing to train
    if not isinstance(optimizer, keras.optimizers.Optimizer):
        raise ValueError(
            "optimizer must be a keras.optimizers.Optimizer, a Keras optimizer "
            f"name, or a zero-arg function that makes one; received {given!r}"
        )
    scaled = isinstance(optimizer, keras.optimizers.LossScaleOptimizer)
    if loss_scaling and not scaled:
        with tf.device(device):
            optimizer = keras.optimizers.LossScaleOptimizer(optimizer)
    return optimizer


class Update:
    """Applies combined gradients for one engine, by its policies.

    Call ``build`` with the model's trainable variables before the first step.

    Args:
      optimizer: the Keras optimizer (a ``LossScaleOptimizer`` for loss scaling).
      device: the variable device (accumulators live there).
      on_nonfinite: ``"ignore"``, ``"skip"`` or ``"raise"``.
      accumulate_steps: apply every this many steps.

    Raises:
      ValueError: an unknown policy, ``"raise"`` with a LossScaleOptimizer, or
        ``accumulate_steps`` that is not a positive integer.
    """

    def __init__(
        self,
        optimizer: keras.optimizers.Optimizer,
        device: str,
        on_nonfinite: NonfinitePolicy = "ignore",
        accumulate_steps: int = 1,
    ):
        self.optimizer = optimizer
        self.device = device
        self.variables: list = []
        self.on_nonfinite = _check_policy(on_nonfinite, self.loss_scaled, optimizer)
        if not isinstance(accumulate_steps, int) or accumulate_steps < 1:
            raise ValueError(
                f"accumulate_steps must be a positive integer; received "
                f"{accumulate_steps!r}"
            )
        self.accumulate_steps = accumulate_steps
        self._divide_window = True  # set when traced: a mean, or a sum
        self.accumulator: Accumulator | None = None
        # Steps (batches) trained, skipped ones and micro-batches included: the x
        # axis of the logs and the checkpoints' number.
        self.steps: tf.Variable | None = None
        self.applied: list = []  # the variables with a gradient, set when traced
        self._flush_fn = tf.function(self._apply_window)

    def build(self, variables: Sequence[Any]) -> None:
        """Takes the trainable variables; makes the accumulators if accumulating."""
        self.variables = list(variables)
        if self.steps is None:
            with tf.device(self.device):
                self.steps = tf.Variable(0, dtype=tf.int64, trainable=False)
        if self.accumulate_steps > 1 and self.accumulator is None:
            self.accumulator = Accumulator(self.variables, self.device)

    def state(self) -> dict[str, Any]:
        """What a checkpoint saves of the update: the steps counter, and the
        window's sums (a run stopped inside a window resumes inside it)."""
        if self.accumulator is None:
            return {"steps_done": self.steps}
        return {"steps_done": self.steps, "accumulator": self.accumulator}

    @property
    def loss_scaled(self) -> bool:
        return isinstance(self.optimizer, keras.optimizers.LossScaleOptimizer)

    @property
    def checks(self) -> bool:
        """Whether the step checks its gradients (and so returns flags)."""
        return self.on_nonfinite != "ignore" or self.loss_scaled

    def count_step(self) -> None:
        """Advances the steps counter: once per step, applied, skipped or
        accumulated."""
        self.steps.assign_add(1)

    def loss_scale(self) -> Any:
        """What each tower's loss is multiplied by before its gradient: the loss
        scale of a ``LossScaleOptimizer``, else 1."""
        if not self.loss_scaled:
            return 1.0
        return self.optimizer.scale_loss(tf.constant(1.0))

    def apply(
        self,
        grads: list,
        variables: Sequence[Any],
        also: Callable[[], Any],
        weight: Any,
    ) -> tf.Tensor | None:
        """Applies (or accumulates) one step's combined gradients.

        Args:
          grads: the combined gradient per variable (None for no gradient).
          variables: the trainable variables, in the order of ``grads``.
          also: the step's other update (BN moving statistics), run with it.
          weight: what this step weighs in an accumulation window: its examples
            for a mean loss, or None for a sum (every step counts once).

        Returns:
          Per applied variable, whether its gradient was finite, or None when the
          policy does not check.
        """
        if not variables:
            # As Keras' step: nothing to apply, the optimizer's iterations stay.
            warnings.warn(
                "The model does not have any trainable weights.", stacklevel=2
            )
            self.applied = []
            _returning_none(also)()
            return None
        pairs = [(g, v) for g, v in zip(grads, variables) if g is not None]
        if not pairs:
            raise ValueError(
                "no trainable variable gets a gradient from the loss; received a "
                "loss that does not depend on the model's variables"
            )
        self.applied = [v for _, v in pairs]
        if self.accumulator is None:
            return self._apply_or_skip(pairs, also)
        return self._accumulate(pairs, also, weight)

    def raise_if_nonfinite(self, finite: Any, loss: Any = None) -> None:
        """With ``on_nonfinite="raise"``: raises if a flag of the step is False.

        Args:
          finite: the flags ``apply`` (or ``flush``) returned, or None.
          loss: the step's loss, for the message (None after a flush).

        Raises:
          FloatingPointError: naming the first variable whose combined gradient
            had an inf or NaN; nothing was applied.
        """
        if finite is None or self.on_nonfinite != "raise":
            return
        name = first_nonfinite(finite, self.applied)
        if name is not None:
            raise FloatingPointError(
                f"the combined gradient of {name!r} is not finite (inf or NaN); "
                "nothing was applied (on_nonfinite='raise'). Received "
                + ("" if loss is None else f"a batch with loss {float(loss)} and ")
                + "gradients with inf or NaN."
            )

    def flush(self) -> None:
        """Applies a partly filled accumulation window now (fit: at epoch end).

        Raises:
          FloatingPointError: with ``on_nonfinite="raise"``, the window's
            gradient is not finite; nothing was applied.
        """
        if self.accumulator is None or not int(self.accumulator.count.numpy()):
            return
        self.raise_if_nonfinite(self._flush_fn())

    # -- internals ----------------------------------------------------------------

    def _apply_or_skip(self, pairs: list, also: Callable[[], Any]):
        also = _returning_none(also)  # tf.cond's branches must match
        if not self.checks:
            self.optimizer.apply_gradients(pairs)
            also()
            return None
        if self.loss_scaled:
            # The optimizer unscales, checks, applies or skips and adjusts its
            # scale; the other update follows the same decision.
            self.optimizer.apply_gradients(pairs)
            return if_finite([g for g, _ in pairs], also)

        def update():
            self.optimizer.apply_gradients(pairs)
            also()

        return if_finite([g for g, _ in pairs], update)

    def _accumulate(self, pairs: list, also: Callable[[], Any], weight: Any):
        # A mean loss was divided by this step's examples: weight it back by
        # them, and divide the window's sum by its total, as one step on all of
        # it would. A sum adds up as it is.
        self._divide_window = weight is not None
        if self.checks:
            # The moving statistics update per micro-batch (each is a forward
            # pass), unless its own gradients are not finite.
            if_finite([g for g, _ in pairs], also)
        else:
            also()
        self.accumulator.add(pairs, 1.0 if weight is None else weight)
        ready = self.accumulator.count >= self.accumulate_steps
        finite = tf.cond(ready, self._apply_window, self._all_finite)
        return finite if self.checks else None

    def _apply_window(self) -> tf.Tensor:
        """Applies the accumulated mean and empties the accumulators."""
        divisor = self.accumulator.weight if self._divide_window else 1.0
        pairs = [
            (self.accumulator.read(v) / tf.cast(divisor, v.dtype), v)
            for v in self.applied
        ]
        finite = self._apply_or_skip(pairs, lambda: None)
        deps = [finite] if finite is not None else []
        with tf.control_dependencies(deps + [g for g, _ in pairs]):
            self.accumulator.reset()
        return finite if finite is not None else self._all_finite()

    def _all_finite(self) -> tf.Tensor:
        return tf.ones([len(self.applied)], tf.bool)


def finite_flags(grads: list) -> tf.Tensor:
    """Per gradient, whether every value is finite (slices: their values)."""
    return tf.stack(
        [
            tf.reduce_all(
                tf.math.is_finite(g.values if isinstance(g, tf.IndexedSlices) else g)
            )
            for g in grads
        ]
    )


def if_finite(grads: list, update: Callable[[], Any]) -> tf.Tensor:
    """Runs ``update()`` only if every gradient is finite (the one rule for
    skipping an apply, a model's own step's included); returns the flags."""
    flags = finite_flags(grads)  # bool[V]
    tf.cond(tf.reduce_all(flags), _returning_none(update), lambda: None)
    return flags


def first_nonfinite(flags: Any, variables: Sequence[Any]) -> str | None:
    """The path of the first variable whose flag is False (a name given for
    it, as it is), or None."""
    flags = np.asarray(flags)
    if flags.all():
        return None
    first = variables[int(np.argmin(flags))]
    return getattr(first, "path", first)


def _returning_none(fn: Callable[[], Any]) -> Callable[[], None]:
    def run() -> None:
        fn()

    return run


def _check_policy(policy: Any, loss_scaled: bool, optimizer: Any) -> str:
    if policy not in NONFINITE_POLICIES:
        raise ValueError(
            f"on_nonfinite must be one of {list(NONFINITE_POLICIES)}; "
            f"received {policy!r}"
        )
    if policy == "raise" and loss_scaled:
        raise ValueError(
            "on_nonfinite='raise' cannot be used with a LossScaleOptimizer, which "
            "expects some non-finite steps and skips them itself; received "
            f"{type(optimizer).__name__}. Use 'skip' or 'ignore'."
        )
    return policy
