"""The data path of one step: split shards in, one update's gradients out.

``step.py`` runs the phases in order (split, each tower's forward and backward,
the divisors, combine, apply, metrics); ``builtin.py`` is one tower's work;
``runner.py`` decides how the towers run, for every step: alone, once
(``phases.py``: one trace for every tower, cut into phases where the towers
meet by sums, ``cut.py`` cutting it; ``xla.py``: each phase one XLA
computation) or in turns (``turns.py``); ``losses.py`` makes T shards'
losses add up to the batch's; ``metrics.py`` updates the model's own metrics
from every tower's predictions; ``batches.py`` checks a batch on the host;
``own.py`` runs a model's own ``train_step`` on every tower, meeting at
its applies (``applies.py``; ``copies.py``: the metrics of a copy per
tower). Every meeting of the towers mid-step goes through a tower's seat
(``seats.py``). The rules a Keras feature needs to be one device's
(BatchNormalization, draws, assigned state, coupled losses, the probe) are
in ``rules/``.

May import: ``towers.cluster``, ``towers.placement`` and the top-level
building blocks (``split``, ``combine``, ``reducers``, ``devices``, ``options``,
``_keras``, ``_runtime``); never the engine, ``training`` or ``explain``.
"""
