"""Find devices, split one into logical devices, and validate device names.

Every device name the engine keeps is canonical: ``/device:CPU:0``, the form
``tf.config.list_logical_devices()`` reports. Users may write ``/cpu:0``, ``GPU:1`` or
a full ``/job:localhost/replica:0/task:0/device:CPU:0``; all name the same thing.
"""

from __future__ import annotations

from collections.abc import Sequence

import tensorflow as tf

_KINDS = ("CPU", "GPU")
# A logical GPU needs a memory limit; this is the default share when none is given.
_DEFAULT_GPU_MEMORY_MB = 1024


def virtual_devices(
    n: int, kind: str = "CPU", memory_limit_mb: int | None = None
) -> list[str]:
    """Splits the first physical device of ``kind`` into ``n`` logical devices.

    Must run before TensorFlow initialises its devices (before the first op or
    ``list_logical_devices`` call); it does not initialise TensorFlow itself, so
    a cluster can start after it. Calling it again with the same ``n`` afterwards
    returns the same names, so scripts and tests can both call it.

    Args:
      n: number of logical devices, at least 1.
      kind: ``"CPU"`` (the host) or ``"GPU"`` (the first GPU).
      memory_limit_mb: memory per logical GPU (GPU only); default 1024.

    Returns:
      The logical device names, e.g. ``["/device:CPU:0", ..., "/device:CPU:3"]``.

    Raises:
      ValueError: ``n`` is not a positive int, ``kind`` is unknown, or there is no
        physical device of that kind.
      RuntimeError: TensorFlow is already initialised with a different split.

    Example:
      >>> import towers
      >>> towers.virtual_devices(8)  # the test suite's conftest made 8 already
      ['/device:CPU:0', '/device:CPU:1', '/device:CPU:2', '/device:CPU:3', \
'/device:CPU:4', '/device:CPU:5', '/device:CPU:6', '/device:CPU:7']
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be a positive int; received n={n!r}")
    kind = _check_kind(kind)
    physical = tf.config.list_physical_devices(kind)
    if not physical:
        raise ValueError(
            f"no physical {kind} device to split; received kind={kind!r}, "
            f"available: {[d.name for d in tf.config.list_physical_devices()]}"
        )
    if kind == "GPU":
        limit = memory_limit_mb or _DEFAULT_GPU_MEMORY_MB
        config = [tf.config.LogicalDeviceConfiguration(memory_limit=limit)] * n
    else:
        config = [tf.config.LogicalDeviceConfiguration()] * n
    try:
        tf.config.set_logical_device_configuration(physical[0], config)
    except RuntimeError:
        existing = _logical_names_of(physical[0], kind)
        if len(existing) == n:
            return existing
        raise RuntimeError(
            f"TensorFlow is already initialised with {len(existing)} logical {kind} "
            f"device(s) on {physical[0].name}; received virtual_devices({n}). Call "
            "towers.virtual_devices before any TensorFlow op runs (first thing in "
            "the script, or in conftest.py for tests)."
        ) from None
    # Named without listing them: listing would initialise TensorFlow, and a
    # cluster's runtime (towers/cluster/cluster.py) must still start after this.
    return [f"/device:{kind}:{i}" for i in range(n)]


def _logical_names_of(physical: tf.config.PhysicalDevice, kind: str) -> list[str]:
    # Logical devices of the first physical device come first in TensorFlow's list.
    count = len(tf.config.get_logical_device_configuration(physical) or [None])
    return [local_name(d.name) for d in tf.config.list_logical_devices(kind)][:count]


def _check_kind(kind: str) -> str:
    if not isinstance(kind, str) or kind.upper() not in _KINDS:
        raise ValueError(f"kind must be one of {list(_KINDS)}; received kind={kind!r}")
    return kind.upper()


def available_devices() -> list[str]:
    """Returns the canonical names of every logical device TensorFlow sees."""
    return [local_name(d.name) for d in tf.config.list_logical_devices()]


def default_devices() -> list[str]:
    """Every logical GPU if there is one, else the first CPU."""
    gpus = [local_name(d.name) for d in tf.config.list_logical_devices("GPU")]
    return gpus or [local_name(tf.config.list_logical_devices("CPU")[0].name)]


def local_name(name: str) -> str:
    """``/device:CPU:0`` for this process's devices, also when it is a worker of a
    cluster (where TensorFlow lists ``/job:worker/replica:0/task:1/device:CPU:0``;
    only the process's own devices are listed there).

    Example:
      >>> local_name("/job:worker/replica:0/task:1/device:CPU:0")
      '/device:CPU:0'
    """
    spec = tf.DeviceSpec.from_string(name)
    return f"/device:{spec.device_type}:{spec.device_index}"


def canonical_device(name: str, argument: str = "devices") -> str:
    """Returns the canonical local name of ``name``, checking that it exists.

    Args:
      name: a device name such as ``"/cpu:0"``, ``"GPU:1"`` or ``"/device:CPU:2"``.
      argument: the argument ``name`` was given as, for the error.

    Returns:
      The name as TensorFlow lists it, e.g. ``"/device:CPU:0"``.

    Raises:
      ValueError: the name does not parse or no such device exists.

    Example:
      >>> canonical_device("/cpu:1")
      '/device:CPU:1'
    """
    available = available_devices()
    if not isinstance(name, str):
        raise ValueError(
            f"{argument} must name a device with a string; received {name!r}, "
            f"available: {available}"
        )
    try:
        spec = tf.DeviceSpec.from_string(name if "/" in name else "/" + name)
    except ValueError:
        spec = None
    is_local = spec is not None and spec.job in (None, "localhost")
    if spec is None or not spec.device_type or not is_local:
        raise ValueError(
            f"{argument} must exist; received {name!r}, available: {available}"
        )
    canonical = f"/device:{spec.device_type.upper()}:{spec.device_index or 0}"
    if canonical not in available:
        raise ValueError(
            f"{argument} must exist; received {name!r}, available: {available}"
        )
    return canonical


def resolve_devices(devices: Sequence[str] | None = None) -> list[str]:
    """Validates tower devices and returns their canonical names.

    Args:
      devices: device names, one per tower, or ``None`` for the default (every GPU,
        else the CPU).

    Returns:
      Canonical names, one per tower, in the order given.

    Raises:
      ValueError: the list is empty, a string, names an unknown device, or repeats
        one (two towers on one device would be one tower that runs twice).

    Example:
      >>> resolve_devices(["/cpu:0", "CPU:1"])
      ['/device:CPU:0', '/device:CPU:1']
    """
    if devices is None:
        return default_devices()
    if isinstance(devices, str):
        raise ValueError(
            f"devices must be a list of device names; received the string "
            f"{devices!r}. Did you mean devices=[{devices!r}]?"
        )
    names = [canonical_device(d) for d in devices]
    if not names:
        raise ValueError(
            f"devices must name at least one device; received devices=[], "
            f"available: {available_devices()}"
        )
    seen: dict[str, object] = {}
    for given, name in zip(devices, names):
        if name in seen:
            raise ValueError(
                f"devices must not repeat; received {given!r} and {seen[name]!r}, "
                f"both {name}. For more towers than devices, split a device with "
                "towers.virtual_devices(n)."
            )
        seen[name] = given
    return names


def same_device(a: str, b: str) -> bool:
    """Whether two device strings (full or short form) name the same local device."""
    spec_a, spec_b = tf.DeviceSpec.from_string(a), tf.DeviceSpec.from_string(b)
    return (spec_a.device_type or "").upper() == (
        spec_b.device_type or ""
    ).upper() and (spec_a.device_index or 0) == (spec_b.device_index or 0)


def describe_devices() -> list[dict[str, str]]:
    """Physical and logical devices TensorFlow sees, for ``towers devices``.

    Returns:
      One dict per device: ``{"name", "kind", "level"}`` with level ``"physical"``
      or ``"logical"``.
    """
    rows = [
        {"name": d.name, "kind": d.device_type, "level": "physical"}
        for d in tf.config.list_physical_devices()
    ]
    rows += [
        {"name": d.name, "kind": d.device_type, "level": "logical"}
        for d in tf.config.list_logical_devices()
    ]
    return rows
