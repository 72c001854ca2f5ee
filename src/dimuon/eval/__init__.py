"""``dimuon eval``: generation quality over a run's checkpoints (``run``), and runs side by side (``compare``).

Layering: a command. It may import the building blocks (``dimuon.dit``, including its checkpoint
reader, ``dimuon.data``, ``dimuon.metrics``), ``dimuon.optim``, ``dimuon.io`` and ``dimuon.log``; it must
not import the other commands (``dimuon.train``, ``dimuon.bench``). What scores samples and the
results store live in ``dimuon.metrics``, which the training loop shares; this package adds run
discovery, checkpoint loading, the per-checkpoint loop and ``--compare``.
"""
