"""The rules: a module per Keras feature that one device's arithmetic needs a
rule for under towers, each found on the user's model rather than declared.

``batchnorm.py`` (a batch's statistics, the moving ones moved once),
``balancing.py`` (a mixture of experts' load-balancing sums), ``coupled.py``
and ``whole_batch.py`` (a loss or a pass that couples the batch's examples),
``gather.py`` (``towers.gather``: every tower's rows), ``draws.py`` and
``places.py`` (random draws as one device's), ``state.py`` and
``assignments.py`` (state a pass or a model's own step assigns, once),
``grad_rules.py`` (gradients whose sum is not one device's), and the probe
that finds how a step reads its batch (``probe.py``, ``loss_kinds.py``,
``loss_terms.py``).

May import: ``towers.step``'s meetings (``seats.py``, a cluster's handle
included) and ``hooks.py``, and the top-level building blocks; never the
step, a tower's work or the runner that use them.
"""
