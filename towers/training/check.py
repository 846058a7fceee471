"""Checked, not assumed: towers' step against Keras' own on one device.

Every rule that makes the towers exact was found by someone trying a model;
the next may need one nobody wrote. So before the first update of a fit, and
on any batch a user gives (``Towers.check``), the engine runs the model's own
``train_step`` (Keras' unless overridden) on the whole batch on the variable
device, from the same variables, optimizer state, metrics and seed states,
then puts them back; towers' step runs, and what each changed is compared:

    Δ_towers = after_towers - before          Δ_keras = after_keras - before
    relative(v) = ||Δ_towers - Δ_keras|| / ||Δ_keras||

A variable differs when what is left of ``|Δ_towers - Δ_keras|`` past each
element's rounding (a few ulps of its value, and a share of the largest
change of its kind) has a norm over :data:`RTOL` (by the compute dtype)
times ``||Δ_keras||``. Rounding alone never raises it:
an element whose gradient one device computes at the noise of its sums
(below :data:`NOISE` times the largest gradient; an attention key's bias,
a bias before BatchNormalization) takes a step of noise under Adam, and is
left out (so are the optimizer slots that hold it). Where the model computes
in less than float64 and a variable is apart enough for rounding to hide a
mechanism, the same step is compared in the model's float64 twin
(``twin.py``); where one is past the tolerance there, the twin tells whether
rounding put it there (Adam's first step moves an element whose gradient
rounding tipped by twice the rate), but not under a loss scale. Integer
state (seeds, step counts) must be equal. A metric's result that differs is
warned of (the weights trained as one device's, what fit reports does not).
A variable a layer assigns by a declared aggregation follows it
(``state.py``).

Where the check cannot compare it says so once and steps on: TensorFlow's
stateful random ops (each run draws anew), a draw towers named, a cluster
(the other workers' shards), options that are per tower on purpose,
``accumulate_steps``, a model whose own step does not run on one device
(towers' step then says what is wrong).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import numpy as np

from towers._keras import global_seed_kept
from towers.step.rules.loss_kinds import coupling_layer
from towers.training.check_state import (
    Kept,
    Watched,
    compute_dtype,
    engine_state,
    kept_run,
    not_compared,
    watched,
    with_slots,
)
from towers.training.comparison import Comparison, Difference
from towers.training.one_device import OneDevice
from towers.training.twin import twin_comparison

# How far one device's change and towers' may be apart, relative to the
# change, by the dtype the model computes in. float64 leaves rounding at
# ~1e-13 on MobileNetV2; float32 does not: a ReLU6 gate or a BatchNormalization
# channel that rounding tips one way on one device and the other on the
# towers moves every layer before it, and MobileNetV2 at random init (32x32,
# batch 32, SGD) measured up to 6.7 % on a variable (2, 4 and 8 towers, 13
# seeds; 4 of them above 3 %). The check refuses past twice that in 32 and
# 16 bits (the silent mismatches it exists for were 6 % to 16x: a float32
# model's 6 % is the float64 tests' to find). Rounding's reach is not cheap
# to measure per model: 16 orders of one batch's rows on one device ranged
# from 0 to 5.9 % (the towers' 5.9 % among them), so a few miss it.
RTOL = {
    "float64": 1e-7, "float32": 0.15, "float16": 0.15, "bfloat16": 0.2,
    "float8": 0.15,
}  # fmt: skip
# An element whose one-device gradient is below NOISE * eps(dtype) times the
# largest gradient of the step is rounding's: its sign is noise (left out).
NOISE = 1e3
# ... but at most this share of the largest gradient (16-bit sums).
MAX_NOISE = 1e-2
# An absolute floor, as a share of the largest change of its kind (weights',
# the optimizer's, the metrics'): a change that is 0 on one device (a bias
# before BatchNormalization) is rounding of that size there (float64
# measured 1.3e-12 of it on ResNet50, 4e-9 on MobileNetV2).
ATOL = {"float64": 1e-8, "float32": 1e-4, "float16": 1e-2, "bfloat16": 5e-2,
        "float8": 5e-2}  # fmt: skip
ULPS = 16  # of a value's own magnitude a change may differ by (b + Δ's rounding)


def compare(
    entries: list[Watched],
    before: list[np.ndarray],
    towers_after: list[np.ndarray],
    keras_after: list[np.ndarray],
    grads: dict[int, np.ndarray],
    compute_dtype: str,
) -> list[Difference]:
    """Each entry's :class:`Difference`, by the module docstring's rule.

    >>> kernel = Watched("dense/kernel", "layer dense", None, key=1)
    >>> before, keras_after = [np.zeros(2)], [np.array([1.0, 2.0])]
    >>> [d.relative for d in compare([kernel], before, [np.array([1.0, 2.0])],
    ...                             keras_after, {}, "float64")]
    [0.0]
    >>> d = compare([kernel], before, [np.ones(2)], keras_after, {}, "float64")
    >>> d[0].path, round(d[0].relative, 3), d[0].differs  # moved [1, 1], not [1, 2]
    ('dense/kernel', 0.447, True)
    """
    rtol = RTOL.get(compute_dtype, RTOL["float32"])
    # Gradients add up in 16 bits at worst (float8 layers' in float32).
    floor = min(NOISE * _eps(compute_dtype.replace("float8", "float32")), MAX_NOISE)
    largest = max([float(g.max(initial=0.0)) for g in grads.values()] + [0.0])
    floats = [np.issubdtype(b.dtype, np.floating) for b in before]
    keeps = [
        _kept(grads.get(e.key), b, floor * largest) if is_float else None
        for e, b, is_float in zip(entries, before, floats)
    ]
    # Each float entry's kept elements once (``_elements``): (b, t, k, kept).
    kept = [
        None if keep is None else (*_elements(keep, b, t, k), keep)
        for b, t, k, keep in zip(before, towers_after, keras_after, keeps)
    ]
    # The largest change of each kind (layers', optimizers', metrics'): a
    # change of ATOL of it is rounding of its size wherever it lands.
    scale: dict[str, float] = {}
    for e, values in zip(entries, kept):
        if values is not None:
            kind = e.whose.split()[0]
            change = np.abs(values[2] - values[0]).max(initial=0.0)
            scale[kind] = max(scale.get(kind, 0.0), float(change))
    atol = ATOL.get(compute_dtype, ATOL["float32"])
    differences = []
    for entry, b0, t, k, values in zip(
        entries, before, towers_after, keras_after, kept
    ):
        path, whose = entry.path, entry.whose
        if values is None:  # integers: seeds, counts
            same = np.array_equal(t, k)
            differences.append(Difference(path, whose, 0.0 if same else 1.0, not same))
            continue
        b, t, k, keep = values
        off, moved = np.abs(t - k), np.abs(k - b)
        ulps = ULPS * _eps(str(b0.dtype)) * np.maximum(np.abs(b), np.abs(k))
        # Past each element's rounding, the rest as a norm against the
        # change's: a systematic difference shows, one noisy element of a
        # deep float32 network (a depthwise kernel's, 1e-3) does not.
        excess = np.maximum(off - ulps - atol * scale[whose.split()[0]], 0.0)
        norm, worst = float(np.linalg.norm(moved)), float(np.linalg.norm(off))
        relative = worst / norm if norm > 0 else (0.0 if worst == 0 else np.inf)
        noise = int(keep.size - keep.sum())
        differs = bool(np.linalg.norm(excess) > rtol * norm)
        differences.append(Difference(path, whose, float(relative), differs, noise))
    return differences


def _elements(keep: np.ndarray, *values: np.ndarray) -> list[np.ndarray]:
    """``values``' elements that ``keep`` marks, flat, in float64 where they
    are, else float32: a difference of two float32 values near each other
    is exact there, and a far one's rounding is far below any tolerance
    (casting ResNet50's 25M weights thrice took 1.7 s)."""
    every = bool(keep.all())
    dtype = np.float64 if values[0].dtype == np.float64 else np.float32
    return [
        np.asarray(v, dtype).ravel() if every else np.asarray(v, dtype)[keep]
        for v in values
    ]


def _kept(grad: Any, before: np.ndarray, floor: float) -> np.ndarray:
    """The elements compared: all but those whose one-device gradient is
    below ``floor`` (rounding's)."""
    if grad is None or grad.size != before.size:
        return np.ones(before.shape, bool)
    return grad.reshape(before.shape) >= floor


def _eps(dtype: str) -> float:
    if dtype == "float8":
        return 2.0**-2
    return 2.0**-7 if dtype == "bfloat16" else float(np.finfo(dtype).eps)


def checked(
    engine: Any,
    batches: list,
    run: Callable[[], Any],
    keep: bool = True,
    when: str = "its first step",
    twin: bool = True,
):
    """Runs towers' ``run()`` (its step on ``batches``) checked against the
    model's own ``train_step`` on one device. Returns ``(run's output, the
    Comparison)``; ``keep`` False: every variable put back after, as before;
    ``when``: the step and why it is checked, for the refusal; ``twin``: the
    float64 twin asked where there is room (``twin.py``).

    Raises:
      ValueError: ``keep`` and a variable differs: named, everything put back.
    """
    why, reference = not_compared(engine), None
    if why is None:
        with global_seed_kept():  # its trace's Python random draws, towers' too
            reference, why = _reference(engine, batches)
    if why is not None:
        out = run() if keep else kept_run(engine, run)
        return out, Comparison([], skipped=why)
    placement = engine.placement
    kept = Kept(engine_state(engine))
    try:
        with global_seed_kept():
            grads = _run_reference(engine, batches, reference, kept)
    except Exception as error:  # noqa: BLE001 - towers' step says its own
        kept.restore()
        out = run() if keep else kept_run(engine, run)
        return out, Comparison([], skipped=_not_run(error))
    # Read after: an optimizer the reference built at its first apply too.
    entries = watched(placement.model, placement.optimizers[:1])
    keras_after = [e.read() for e in entries]
    kept.restore()
    before = kept.read(entries)
    grads = with_slots(grads, entries, placement.model.trainable_variables)
    out = run()
    unplaced = engine.step.runner.learned.draws_named()
    why = f"towers named draws it cannot make one device's: {unplaced}"
    if not unplaced and not _finite(out):  # its policy, declared: not Keras'
        why = "its gradients were not finite and towers applied nothing"
    if unplaced or not _finite(out):  # towers said so already
        if not keep:
            kept.restore()
        return out, Comparison([], skipped=why)
    # What a layer assigns by a declared aggregation follows it, as under
    # tf.distribute (state.py): the user's choice, not one device's.
    declared = {p for p, rule in engine.step.assigned.items() if rule != "none"}
    entries, before, keras_after = _without(declared, entries, before, keras_after)
    towers_after = [e.read() for e in entries]
    dtype = compute_dtype(engine.model)
    comparison = Comparison(
        compare(entries, before, towers_after, keras_after, grads, dtype)
    )
    if twin:
        comparison.twin = twin_comparison(engine, batches, kept, comparison)
    if not keep or comparison.differs:
        kept.restore()
    if keep and comparison.differs:
        raise ValueError(comparison.refusal(_coupling(engine, batches[0][0]), when))
    if keep and comparison.reports_differ:
        named = ", ".join(
            f"{d.path} {d.relative:.3g} relative" for d in comparison.reports_differ
        )
        warnings.warn(
            f"towers' step at {when} trained as one device does, but what it reports "
            f"differs from the model's own train_step on one device: {named}; "
            "Towers.check(x, y) prints every value",
            stacklevel=4,
        )
    return out, comparison


def _reference(engine: Any, batches: list) -> tuple:
    """The one-device step (``one_device.py``), or why there is none to
    compare with: stateful draws, or it does not run (towers' own step then
    says what is wrong in its words)."""
    try:
        jit, model = engine.step.builtin.jit.enabled, engine.model
        # Eager where it can: an optimizer built at its first apply there.
        reference = OneDevice(model, batches, engine.variable_device, jit)
    except Exception as error:  # noqa: BLE001 - towers' step says its own
        return None, _not_run(error)
    if reference.draws:
        why = f"the step draws with TensorFlow's stateful {reference.draws}: "
        return None, why + "each run draws anew"
    return reference, None


def _run_reference(engine: Any, batches: list, reference: Any, kept: Kept) -> dict:
    """The reference's gradients; an eager one that fails (a layer's own
    gradient that only a trace takes: float8's) is traced and run again."""
    try:
        grads = reference.run()[1]
        kept.extend(reference.built)  # put back to their first values
        return grads
    except Exception:  # noqa: BLE001 - traced next; its error is the one said
        kept.extend(reference.built)
        if reference.traced:
            raise
        kept.restore()
        jit = engine.step.builtin.jit.enabled
        device = engine.variable_device
        traced = OneDevice(engine.model, batches, device, jit, unbuilt=True)
        return traced.run()[1]


def _finite(out: Any) -> bool:
    """Whether towers' run applied its steps: a non-finite one is skipped
    by ``on_nonfinite`` or loss scaling, with what it assigned, where Keras'
    step applies (or skips the apply alone)."""
    finite = out.get("finite") if isinstance(out, dict) else None
    return finite is None or bool(np.all(np.asarray(finite)))


def _not_run(error: Exception) -> str:
    first = (str(error).strip().splitlines() or [""])[0][:200]
    return (
        "the model's own train_step did not run on one device "
        f"({type(error).__name__}: {first})"
    )


def _coupling(engine: Any, x: Any) -> str | None:
    """The layer whose outputs couple ``x``'s examples, if that explains a
    difference (``probe.coupling_layer``)."""
    try:
        return coupling_layer(engine.model, x, engine.variable_device)
    except Exception:  # noqa: BLE001 - it only explains; the refusal stands
        return None


def _without(paths: set, entries: list, *values: list) -> tuple:
    chosen = [i for i, e in enumerate(entries) if e.path not in paths]
    return tuple([column[i] for i in chosen] for column in (entries, *values))
