"""towers: data-parallel training with towers on TensorFlow 2."""

try:
    import tensorflow  # noqa: F401
except ImportError as error:  # pragma: no cover - depends on the install
    raise ImportError(
        "towers needs TensorFlow. Install it with the extra for your machine: "
        "pip install 'towers[cpu]' (CPU only) or 'towers[gpu]' (NVIDIA GPUs)."
    ) from error

from towers.combine import combine_gradients
from towers.devices import virtual_devices
from towers.engine import Towers
from towers.split import split_batch, split_sizes

__all__ = [
    "Towers",
    "combine_gradients",
    "split_batch",
    "split_sizes",
    "virtual_devices",
]
__version__ = "0.1.0"
