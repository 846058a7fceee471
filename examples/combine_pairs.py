"""Combining ``(gradient, variable)`` pairs, as TF1 code wrote them.

TF1 towers handed ``opt.compute_gradients(loss)`` lists around: one list of
``(gradient, variable)`` pairs per tower, grouped across towers with
``zip(*tower_grads)``. Two habits made that go wrong:

- Filtering ``None`` per tower (``[(g, v) for g, v in grads if g is not None]``,
  which ``apply_gradients`` wanted) before the ``zip``: if one tower does not use a
  variable, its list is shorter and ``zip`` pairs *different variables'* gradients
  by position. With equal shapes nothing fails; the update is silently wrong,
  and ``zip`` drops the last variable without a word.
- Averaging ``IndexedSlices`` (an embedding's gradient) with ``expand_dims`` and
  ``concat`` turns each tower's few rows into a dense ``[vocab, dim]`` tensor.

``towers.combine_gradients`` takes the same pairs, matches them by variable, not
by position, counts a ``None`` as zero in the towers that have one (and keeps
``None`` where every tower has one), and keeps slices as slices (values and
indices concatenated). Run: ``python examples/combine_pairs.py``.
``--verbose`` keeps TensorFlow's start-up lines.
"""

import sys

import towers
from towers.commands import start_tensorflow

start_tensorflow(verbose="--verbose" in sys.argv)  # its start-up lines, if asked
DEVICES = towers.virtual_devices(2)  # before TensorFlow starts

import numpy as np  # noqa: E402
import tensorflow as tf  # noqa: E402

VOCAB = 1000


def tower_pairs(variables, ids, scale, uses_a, global_batch):
    """One tower's (gradient, variable) pairs; loss = sum over its examples / B."""
    a, b, table = variables
    with tf.GradientTape() as tape:
        rows = tf.gather(table, ids)  # f32[n_t, 3]: an IndexedSlices gradient
        out = tf.reduce_sum(rows, axis=1, keepdims=True) * b
        if uses_a:
            out = out + a
        loss = tf.reduce_sum((out - scale) ** 2) / global_batch
    return list(zip(tape.gradient(loss, variables), variables))


def main():
    with tf.device("/cpu:0"):
        a = tf.Variable(np.full(4, 0.5, "float32"), name="a")
        b = tf.Variable(np.full(4, -1.0, "float32"), name="b")
        table = tf.Variable(
            np.random.default_rng(0).random((VOCAB, 3), "float32"), name="table"
        )
    variables = [a, b, table]
    ids = [np.array([1, 2, 3]), np.array([3, 4])]  # tower 1 never uses `a`
    batch = sum(len(i) for i in ids)
    tower_grads = []
    for t, device in enumerate(DEVICES):
        with tf.device(device):
            tower_grads.append(tower_pairs(variables, ids[t], 2.0, t == 0, batch))

    # The TF1 habit: drop None per tower, then zip by position.
    filtered = [[(g, v) for g, v in pairs if g is not None] for pairs in tower_grads]
    by_position = list(zip(*filtered))
    print(
        "zip(*filtered) groups:",
        [[v.name.split(":")[0] for _, v in group] for group in by_position],
    )
    wrong = tf.add_n([g for g, _ in by_position[0]])  # "a"'s gradient... plus b's

    # towers: the same pairs, unfiltered; None counts as zero in tower 1.
    combined = towers.combine_gradients(tower_grads, reduction="sum")
    print("combine_gradients:", [v.name.split(":")[0] for _, v in combined])
    grad_a = combined[0][0]
    print(
        f"gradient of a: zip-by-position {wrong.numpy()[:2]}..., "
        f"combine_gradients {grad_a.numpy()[:2]}..."
    )

    # Slices stay slices: 5 rows of 3, not two dense [1000, 3] tensors.
    grad_table = combined[2][0]
    dense_average = tf.concat(
        [tf.expand_dims(g, 0) for g, _ in (p[2] for p in tower_grads)], axis=0
    )
    print(
        f"embedding gradient: {type(grad_table).__name__} with values "
        f"{tuple(grad_table.values.shape)}; expand_dims+concat made "
        f"{tuple(dense_average.shape)}"
    )
    assert isinstance(grad_table, tf.IndexedSlices)

    # Check against one device on the whole batch (both towers' examples at once).
    with tf.GradientTape() as tape:
        loss = 0.0
        for t in range(2):
            rows = tf.gather(table, ids[t])
            out = tf.reduce_sum(rows, axis=1, keepdims=True) * b + (a if t == 0 else 0)
            loss += tf.reduce_sum((out - 2.0) ** 2) / batch
    reference = tape.gradient(loss, variables)
    for (got, _), want in zip(combined, reference):
        np.testing.assert_allclose(
            tf.convert_to_tensor(got), tf.convert_to_tensor(want), rtol=1e-5, atol=1e-6
        )
    assert not np.allclose(wrong.numpy(), grad_a.numpy())
    print(
        "combined gradients: towers matches one device (rtol 1e-5); "
        "zip-by-position does not"
    )


if __name__ == "__main__":
    main()
