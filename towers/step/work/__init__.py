"""What a tower computes: the built-in pass (``builtin.py``: forward, the
loss's terms, ``losses.py``, and gradients) or a model's own step
(``own.py``: its ``train_step``, ``test_step``, ``predict_step``, meeting at
each apply, ``applies.py``).

May import: the rules, ``towers.step.run`` and the top-level building blocks;
``hooks.py`` is imported by the rules (it imports none of them).
"""
