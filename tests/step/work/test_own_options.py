"""The engine's options with a model's own train_step, per apply
(towers/step/work/applies.py), against Keras' own fit on one device in float64:
accumulate_steps as one step on each window's batches, and
on_nonfinite skipping (or raising at) an apply whose combined gradient is
not finite, nothing half-applied."""

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.placement.test_placement import OwnStep
from tests.step.work.test_own import gan, guide_model, regression
from tests.step.work.test_own_state import (
    EMAStep,
    assert_every_variable_moved_alike,
    built,
)
from tests.test_equivalence import devices
from towers import Towers

pytestmark = pytest.mark.usefixtures("float64")  # tests/conftest.py
FIT = dict(batch_size=7, epochs=2, shuffle=False, verbose=0)


def accumulating(model, steps):
    """``model`` recompiled as before, its optimizers accumulating ``steps``
    steps as Keras' own do (gradient_accumulation_steps)."""
    for name in ("optimizer", "d_optimizer", "g_optimizer"):
        optimizer = getattr(model, name, None)
        if optimizer is not None:
            optimizer.gradient_accumulation_steps = steps
    return model


@pytest.mark.parametrize("num_towers", [2, 3])
def test_accumulate_steps_trains_as_one_step_on_each_window(num_towers):
    # Batches of 7, 7, 7, 3 in windows of two: one step on 14, one on 10,
    # each micro-batch weighed by its examples, as the built-in step does.
    x, y = regression(24)
    engine = Towers(guide_model(), devices=devices(num_towers), accumulate_steps=2)
    reference = guide_model()
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **{**FIT, "batch_size": 14})

    assert_every_variable_moved_alike(engine.model, reference, before)
    iterations = int(reference.optimizer.iterations)
    assert int(engine.model.optimizer.iterations) == iterations == 4  # 8 steps / 2
    assert engine.steps_done == 8
    # A streaming metric sees each example once, at the window's weights.
    # (The guide's loss tracker takes a number per batch: micro-batches'.)
    np.testing.assert_allclose(
        history.history["mae"], expected.history["mae"], rtol=1e-10
    )


def test_an_epochs_partial_window_is_applied_at_its_end():
    # 29 examples in batches of 8: windows of 8, 8, 8 and of 5 alone, which
    # fit applies as the epoch ends: one step on 24, one on 5, per epoch.
    x, y = regression(29)
    engine = Towers(guide_model(), devices=devices(3), accumulate_steps=3)
    reference = guide_model()
    before = [v.numpy() for v in reference.variables]

    engine.fit(x, y, **{**FIT, "batch_size": 8})
    reference.fit(x, y, **{**FIT, "batch_size": 24})

    assert_every_variable_moved_alike(engine.model, reference, before)
    assert int(engine.model.optimizer.iterations) == 4


def test_accumulate_steps_reaches_every_optimizer_a_gan_applies_with():
    # A GAN's generator step reads the discriminator as the window left it,
    # as Keras' own accumulation does: windows of equal batches agree with it.
    rng = np.random.default_rng(0)
    real, z = rng.standard_normal((24, 2)), rng.standard_normal((24, 3))
    engine = Towers(gan(), devices=devices(3), accumulate_steps=3)
    reference = accumulating(gan(), 3)
    before = [v.numpy() for v in reference.variables]

    engine.fit(real, z, batch_size=8, epochs=2, shuffle=False, verbose=0)
    reference.fit(real, z, batch_size=8, epochs=2, shuffle=False, verbose=0)

    assert_every_variable_moved_alike(engine.model, reference, before)
    assert int(engine.model.d_optimizer.iterations) == 2


def test_an_own_step_resumed_inside_a_window_trains_as_one_never_stopped(tmp_path):
    # One epoch of 3 batches in windows of 2: the checkpoint at its end
    # holds the second window's first batch, which the resumed run finishes.
    x, y = regression(21)
    run = dict(batch_size=7, shuffle=False, verbose=0)
    resumed = Towers(guide_model(), devices=devices(2), accumulate_steps=2)
    resumed.fit(x, y, epochs=1, checkpoint_dir=str(tmp_path), **run)
    resumed = Towers(guide_model(), devices=devices(2), accumulate_steps=2)
    resumed.fit(x, y, epochs=2, checkpoint_dir=str(tmp_path), **run)
    straight = Towers(guide_model(), devices=devices(2), accumulate_steps=2)
    straight.fit(x, y, epochs=2, **run)

    for v, w in zip(resumed.model.variables, straight.model.variables, strict=True):
        np.testing.assert_array_equal(v.numpy(), w.numpy(), err_msg=v.path)


class Scaled(keras.Model):
    """A subclassed model with a weight made in ``__init__`` (so it has
    variables before it is built) and its own train_step."""

    def __init__(self):
        super().__init__()
        self.dense = keras.layers.Dense(1)
        self.scale = self.add_weight(shape=(), initializer="ones", name="scale")

    def call(self, x):
        return self.dense(x) * self.scale

    train_step = OwnStep.train_step  # a tape, compute_loss, one apply


def scaled():
    keras.utils.set_random_seed(3)
    model = Scaled()
    model.compile(keras.optimizers.SGD(0.1), loss="mse")
    return model


def test_a_model_with_variables_before_it_is_built_resumes_its_own_step(tmp_path):
    x, y = regression(21)
    run = dict(batch_size=7, shuffle=False, verbose=0)
    resumed = Towers(scaled(), devices=devices(2))
    assert resumed.model.variables and not resumed.model.built
    resumed.fit(x, y, epochs=1, checkpoint_dir=str(tmp_path), **run)
    resumed = Towers(scaled(), devices=devices(2))
    resumed.fit(x, y, epochs=2, checkpoint_dir=str(tmp_path), **run)
    reference = scaled()
    reference.fit(x, y, epochs=2, **run)

    assert resumed.steps_done == 6
    for v, w in zip(resumed.model.variables, reference.variables, strict=True):
        np.testing.assert_allclose(v.numpy(), w.numpy(), rtol=1e-12, err_msg=v.path)


def test_an_optimizer_accumulating_otherwise_is_refused_by_name():
    model = accumulating(guide_model(), 4)
    engine = Towers(model, devices=devices(2), accumulate_steps=2)
    before = model.get_weights()
    with pytest.raises(ValueError, match="accumulate_steps=2.*accumulates 4 steps"):
        engine.fit(*regression(8), batch_size=8, verbose=0)
    for got, want in zip(model.get_weights(), before):
        np.testing.assert_array_equal(got, want)


def batches_with_nan():
    """Three batches; an example of the second is NaN."""
    x, y = regression(21)
    x[9] = np.nan
    return [(x[i : i + 7], y[i : i + 7]) for i in (0, 7, 14)]


def test_skip_leaves_out_an_apply_whose_gradient_is_not_finite():
    first, poisoned, last = batches_with_nan()
    engine = Towers(guide_model(), devices=devices(2), on_nonfinite="skip")
    reference = guide_model()
    before = [v.numpy() for v in reference.trainable_variables]

    for batch in (first, poisoned, last):
        engine.train_step(*batch)
    for batch in (first, last):  # one device, the poisoned batch left out
        reference.fit(*batch, batch_size=7, shuffle=False, verbose=0)

    # The weights, the optimizer's slots and iterations: as if the poisoned
    # step had not applied (its metrics saw it).
    for ours, theirs, b in zip(
        engine.model.trainable_variables, reference.trainable_variables, before
    ):
        np.testing.assert_allclose(
            ours.numpy() - b, theirs.numpy() - b, rtol=1e-10, atol=1e-13
        )
    for ours, theirs in zip(
        engine.model.optimizer.variables, reference.optimizer.variables, strict=True
    ):
        np.testing.assert_allclose(ours.numpy(), theirs.numpy(), rtol=1e-10)
    assert int(engine.model.optimizer.iterations) == 2


def test_raise_names_the_variable_and_applies_nothing():
    first, poisoned, _ = batches_with_nan()
    engine = Towers(guide_model(), devices=devices(2), on_nonfinite="raise")
    engine.train_step(*first)
    before = [v.numpy() for v in engine.model.trainable_variables]

    with pytest.raises(FloatingPointError, match="kernel.*not finite"):
        engine.train_step(*poisoned)

    for var, b in zip(engine.model.trainable_variables, before):
        np.testing.assert_array_equal(var.numpy(), b)
    assert int(engine.model.optimizer.iterations) == 1


@pytest.mark.parametrize(
    "build, what",
    [(gan, "applies 2 times"), (lambda: built(EMAStep), "assigns .*kernel")],
    ids=["two-applies", "assigns"],
)
def test_raise_with_a_step_it_would_leave_half_applied_is_refused(build, what):
    model = build()
    engine = Towers(model, devices=devices(2), on_nonfinite="raise")
    before = [v.numpy() for v in model.variables]
    rng = np.random.default_rng(0)
    width = model.inputs[0].shape[1] if getattr(model, "inputs", None) else 5
    x = rng.standard_normal((6, 2 if build is gan else width))
    y = rng.standard_normal((6, 3 if build is gan else 2))

    with pytest.raises(ValueError, match=f"on_nonfinite='raise'.*{what}"):
        engine.train_step(x, y)

    for var, b in zip(model.variables, before):
        np.testing.assert_array_equal(var.numpy(), b)


def test_options_with_a_copy_per_tower_are_refused_by_name():
    for option in ({"accumulate_steps": 2}, {"on_nonfinite": "skip"}):
        with pytest.raises(ValueError, match="placement='replicated'"):
            Towers(
                guide_model(),
                devices=devices(2),
                placement="replicated",
                **option,
            )


class UnusedLayer(keras.Model):
    """The guide's step over every trainable variable, one layer unused:
    its gradients are None, and Keras builds the optimizer on it too."""

    def __init__(self):
        super().__init__()
        self.used, self.unused = keras.layers.Dense(2), keras.layers.Dense(2)

    def call(self, x):
        return self.used(x)

    def train_step(self, data):
        x, y = data
        with tf.GradientTape() as tape:
            loss = keras.ops.mean((self(x, training=True) - y) ** 2)
        variables = self.trainable_variables
        self.optimizer.apply(tape.gradient(loss, variables), variables)
        return {"loss": loss}


def test_the_optimizer_is_built_on_every_variable_given_as_keras_builds_it():
    def build():
        keras.utils.set_random_seed(0)
        model = UnusedLayer()
        model.used.build((None, 5))
        model.unused.build((None, 5))  # never in the loss
        model.compile(keras.optimizers.Adam(0.01))
        return model

    x, y = regression(14)
    engine, reference = Towers(build(), devices=devices(2)), build()
    engine.fit(x, y, **FIT)
    reference.fit(x, y, **FIT)
    mine, theirs = engine.model.optimizer.variables, reference.optimizer.variables
    assert [v.shape for v in mine] == [v.shape for v in theirs]
    assert len(mine) == 2 + 2 * 4  # iterations, learning rate; m and v of 4


def executing(k):
    """The guide's model compiled to run ``k`` steps an execution."""
    model = guide_model()
    model.compile(
        optimizer=keras.optimizers.Adam(0.01), loss="mse", metrics=["mae"],
        steps_per_execution=k,
    )  # fmt: skip
    return model


@pytest.mark.parametrize("num_towers", [1, 3])
def test_steps_per_execution_runs_an_own_step_in_the_graphs_loop(num_towers):
    # Batches of 7, 7, 7, 3 by executions of 4: two calls of the loop each
    # (three batches of 7, one of 3), as Keras' fit with the same
    # steps_per_execution runs them.
    x, y = regression(24)
    engine = Towers(executing(4), devices=devices(num_towers))
    calls = []
    run = engine._compiled.run
    engine._compiled.run = lambda kind, *a: calls.append(kind) or run(kind, *a)
    reference = executing(4)
    before = [v.numpy() for v in reference.variables]

    history = engine.fit(x, y, **FIT)
    expected = reference.fit(x, y, **FIT)

    assert calls == ["train_steps"] * 4
    assert engine.trace_count == 2  # the loop, once per shape of batch
    assert_every_variable_moved_alike(engine.model, reference, before)
    for name, values in expected.history.items():
        np.testing.assert_allclose(history.history[name], values, rtol=1e-10)
