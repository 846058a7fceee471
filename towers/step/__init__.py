"""The data path of one step: split shards in, one update out.

``step.py`` runs each step: split, the work, the tail. ``work/`` is what a
tower computes (the built-in pass, or a model's own step); ``run/`` how the
towers run it (the way decided once, a tower's seat and its verbs);
``tail.py`` what runs after the gradients (combine, the workers' sum, the
apply, state and metrics); ``rules/`` a module per Keras feature that needs
a rule to be one device's. ``prepare.py``, ``batches.py`` and ``metrics.py``:
a step's first batch, a batch on the host, the model's own metrics.

May import: ``towers.cluster``, ``towers.placement`` and the top-level
building blocks (``split``, ``combine``, ``reducers``, ``devices``, ``options``,
``_keras``, ``_runtime``); never the engine, ``training`` or ``explain``.
"""
