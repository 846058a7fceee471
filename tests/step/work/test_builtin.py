"""One tower's work: loss share, regularisers, gradients (step/work/builtin.py)."""

import gc

import keras
import numpy as np
import pytest
import tensorflow as tf

from tests.models import build_dense_sparse_unused, dense_sparse_batch
from tests.tolerances import EQUIVALENCE_ATOL, EQUIVALENCE_RTOL
from towers import Towers
from towers.step.rules.batchnorm import MovingStatistics
from towers.step.run import phases
from towers.step.work.builtin import BuiltIn, weights_here
from towers.step.work.losses import StepLoss


def tower_for(model, loss="mse", loss_scale=1.0):
    return BuiltIn(StepLoss(loss), MovingStatistics(lambda: model), lambda: loss_scale)


def train(tower, model, x, y, examples, sample_weight=None):
    """Both halves of a tower's work, for a tower that is the whole step's."""
    tower_pass = tower.forward(model, x, y, sample_weight, examples)
    divisors = [t.divisor for t in tower_pass.terms]
    if examples != len(x):  # this tower is one of several: the step's divisor
        divisors = [d * examples // len(x) for d in divisors]
    return tower.gradients(tower_pass, divisors)


def line(bias=0.0, l2=0.0):
    """y = x @ [1, 2] + bias, with an optional L2 regulariser on the kernel."""
    model = keras.Sequential(
        [
            keras.Input((2,)),
            keras.layers.Dense(
                1,
                kernel_initializer=keras.initializers.Constant([[1.0], [2.0]]),
                bias_initializer=keras.initializers.Constant(bias),
                kernel_regularizer=keras.regularizers.L2(l2) if l2 else None,
            ),
        ]
    )
    return model


def test_loss_share_divides_by_the_whole_steps_examples():
    model = line(bias=1.0)
    x = np.array([[1.0, 0.0], [0.0, 1.0]], "float32")  # predictions 2 and 3
    y = np.zeros((2, 1), "float32")

    result = train(tower_for(model), model, x, y, examples=5)

    # Squared errors 4 and 9 of 2 examples, over the step's 5.
    np.testing.assert_allclose(float(result.loss), (4.0 + 9.0) / 5, rtol=1e-6)
    # d/d bias of sum (p - y)^2 / 5 = 2 (2 + 3) / 5.
    np.testing.assert_allclose(result.grads[1].numpy(), [2.0], rtol=1e-6)
    assert [tuple(p.shape) for p in [result.predictions]] == [(2, 1)]


def test_sample_weights_weigh_the_loss_and_the_gradient():
    model = line(bias=1.0)
    x = np.array([[1.0, 0.0], [0.0, 1.0]], "float32")  # predictions 2 and 3
    y = np.zeros((2, 1), "float32")
    weights = np.array([1.0, 0.0], "float32")  # the second example counts nothing

    result = train(tower_for(model), model, x, y, examples=2, sample_weight=weights)

    # Keras' default reduction divides by the examples, not by the weights.
    np.testing.assert_allclose(float(result.loss), 4.0 / 2, rtol=1e-6)
    np.testing.assert_allclose(result.grads[1].numpy(), [2.0 * 2.0 / 2], rtol=1e-6)


def test_regulariser_is_weighted_by_the_towers_share_of_examples():
    model = line(l2=0.5)
    x, y = np.zeros((2, 2), "float32"), np.zeros((2, 1), "float32")

    tower_pass = tower_for(model).evaluate(model, x, y, None, examples=8)

    # Errors are 0; the L2 term 0.5 * (1 + 4) counts n_t / B = 2 / 8 of itself.
    np.testing.assert_allclose(float(tower_pass.extra), 0.5 * 5.0 * 2 / 8, rtol=1e-6)
    assert tower_pass.tape is None and tower_pass.moments == {}


def test_gradients_are_of_the_scaled_loss():
    model = line(bias=1.0)
    x, y = np.ones((3, 2), "float32"), np.zeros((3, 1), "float32")
    plain = train(tower_for(model), model, x, y, examples=3)

    scaled = train(tower_for(model, loss_scale=8.0), model, x, y, examples=3)

    # The loss reported is unscaled; the gradients carry the scale.
    np.testing.assert_allclose(float(scaled.loss), float(plain.loss), rtol=1e-6)
    for a, b in zip(scaled.grads, plain.grads):
        np.testing.assert_allclose(a.numpy(), 8.0 * b.numpy(), rtol=1e-6)


def test_sparse_gradients_reach_the_combine_as_indexed_slices():
    model = build_dense_sparse_unused()
    tower = tower_for(model, keras.losses.SparseCategoricalCrossentropy(True))
    x, y = dense_sparse_batch(np.random.default_rng(0), 4)
    kinds = {}

    @tf.function
    def tower_grads(x, y):
        grads = train(tower, model, x, y, examples=4).grads
        for var, grad in zip(model.trainable_variables, grads):
            kind = "slices" if isinstance(grad, tf.IndexedSlices) else "dense"
            kinds[var.path.split("/")[-1]] = None if grad is None else kind
        return 0

    tower_grads(x, y)
    assert kinds["embeddings"] == "slices"
    assert kinds["kernel"] == "dense"
    assert kinds["unused"] is None


def test_batch_norm_moments_are_recorded_not_assigned():
    model = keras.Sequential([keras.Input((2,)), keras.layers.BatchNormalization()])
    x = np.array([[1.0, 2.0], [3.0, 6.0]], "float32")
    before = model.layers[0].moving_mean.numpy().copy()

    result = train(tower_for(model), model, x, np.zeros((2, 2), "float32"), 2)

    [(mean, variance, count)] = result.moments[0]  # one call
    np.testing.assert_allclose(mean.numpy(), [2.0, 4.0])
    np.testing.assert_allclose(variance.numpy(), [1.0, 4.0])
    assert float(count) == 2.0
    np.testing.assert_array_equal(model.layers[0].moving_mean.numpy(), before)


def grouped_conv():
    # Keras' TensorFlow backend compiles a grouped convolution with XLA on CPUs,
    # and an XLA computation cannot read a variable that lives on another device.
    return keras.Sequential(
        [
            keras.Input((5, 5, 4)),
            keras.layers.Conv2D(4, 3, groups=2),
            keras.layers.Flatten(),
            keras.layers.Dense(2),
        ]
    )


@pytest.mark.parametrize("placement", ["central", "balanced", "replicated"])
def test_a_layer_that_compiles_with_xla_inside_runs_on_every_tower(placement):
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 5, 5, 4)).astype("float32")
    y = rng.standard_normal((5, 2)).astype("float32")
    engine = Towers(
        grouped_conv,
        "mse",
        keras.optimizers.SGD(0.1),
        devices=["/cpu:0", "/cpu:1"],
        placement=placement,
    )
    reference = grouped_conv()
    reference.set_weights(engine.model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    for _ in range(2):
        engine.train_step(x, y)
        reference.train_on_batch(x, y)

    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )
    np.testing.assert_allclose(
        engine.predict_step(x), reference.predict(x, verbose=0), rtol=1e-5, atol=1e-6
    )
    np.testing.assert_allclose(
        engine.evaluate(x, y, batch_size=5, verbose=0),
        reference.evaluate(x, y, verbose=0),
        rtol=1e-5,
    )


def test_a_layers_own_function_outlives_the_pass_it_was_traced_in(monkeypatch):
    # The towers' pass is traced alone and cut (towers/step/run/cut.py); the grouped
    # convolution's own tf.function, its forward and backward, must stay in the
    # runtime once that traced pass is collected (a collection at any time in a
    # long run; forced here), or the step cannot find them.
    compute = phases.compute

    def then_collected(*args):
        results = compute(*args)
        gc.collect()
        return results

    monkeypatch.setattr(phases, "compute", then_collected)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 5, 5, 4)).astype("float32")
    y = rng.standard_normal((5, 2)).astype("float32")
    engine = Towers(grouped_conv, "mse", keras.optimizers.SGD(0.1),
                    devices=["/cpu:0", "/cpu:1"])  # fmt: skip
    reference = grouped_conv()
    reference.set_weights(engine.model.get_weights())
    reference.compile(optimizer=keras.optimizers.SGD(0.1), loss="mse")

    engine.train_step(x, y)
    reference.train_on_batch(x, y)

    for got, want in zip(engine.model.get_weights(), reference.get_weights()):
        np.testing.assert_allclose(
            got, want, rtol=EQUIVALENCE_RTOL, atol=EQUIVALENCE_ATOL
        )


def test_weights_read_once_on_the_towers_device_and_assignments_kept_for_the_step():
    model = keras.Sequential([keras.Input((2,)), keras.layers.Dense(1)])
    kernel = model.layers[0].kernel
    before = kernel.numpy()
    with tf.device("/cpu:1"), weights_here(model) as scope:
        read = scope.get_current_value(kernel)
        kernel.assign(tf.ones_like(read))  # as a layer's own state update does
        seen = tf.convert_to_tensor(kernel)  # later reads see the assignment
    assert read.device.endswith("CPU:1")
    np.testing.assert_array_equal(seen, np.ones((2, 1)))
    # Kept in the scope for the step to assign once (towers/step/rules/state.py).
    assert list(scope.assigned.values()) == [kernel]
    np.testing.assert_array_equal(kernel.numpy(), before)
