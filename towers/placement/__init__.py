"""Where the variables live, how the towers' gradients meet, and the one apply.

``base.py`` is the ``Placement`` every placement is: it builds the model and
optimizer, combines ``tower_grads[t][v]`` and applies once. ``shared.py`` keeps
one set of variables (``Central``, and ``Balanced`` over the tower devices, with
``balance.py``'s plan); ``replicas.py`` keeps a copy per tower (``Replicated``,
all-reduced on ``collective.py``'s TensorFlow collectives, and ``Independent``).
``update.py`` and ``accumulate.py`` are the apply's policies: skip or raise on
non-finite gradients, loss scaling, accumulating micro-batches, the steps
counter.

May import: the top-level building blocks (``split``, ``combine``,
``reducers``, ``devices``, ``options``, ``_keras``, ``_runtime``) only.
"""
