"""Benchmarks: ``dimuon bench optimizer`` (step time), ``comm`` (communication), ``step`` (the optimizer's share
of a training step), ``census`` (what one step issues at 4-256 ranks), ``traffic`` (bytes a memory-bound step
moves), ``quality`` (a grid of runs) and ``gpu`` (the GPU check).

Layering: a command. It may import the building blocks (``dimuon.dit``, ``dimuon.data``,
``dimuon.metrics``), ``dimuon.optim``, ``dimuon.io`` and ``dimuon.log``, and, alone among the commands,
the other two: ``bench quality`` launches ``dimuon train`` runs (it shares their typed config) and
compares them with ``dimuon eval --compare``. ``dimuon.train`` and ``dimuon.eval`` never import it.
"""
