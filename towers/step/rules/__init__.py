"""The rules: a module per Keras feature that needs one to be one device's
on towers, each found on the user's model rather than declared.

``batchnorm.py`` (a batch's statistics, the moving ones moved once),
``balancing.py`` (a mixture of experts' load-balancing sums), ``coupled.py``
and ``whole_batch.py`` (a loss that couples the batch's examples),
``gather.py`` (``towers.gather``), ``draws.py`` and ``places.py`` (random
draws as one device's), ``state.py`` (state assigned once, by aggregation),
``assignments.py`` and ``metric_updates.py`` (what a model's own step
assigns and updates), ``grad_rules.py`` (gradients whose sum is not one
device's), ``forms.py`` (what a traced value is made of), and the probe that
finds how a step reads its batch (``probe.py``, ``loss_kinds.py``,
``loss_terms.py``).

May import: ``run/seats.py`` (the seat and its verbs), ``work/hooks.py``,
each other and the top-level building blocks; never the step, a work or
the runner that use them.
"""
