"""dimuon's optimizers inside other trainers, at the extension points those trainers define.

- :mod:`dimuon.integrations.torchtitan`: an ``OptimizersContainer`` for torchtitan (0.3.0) whose config
  a torchtitan ``config_registry`` function returns (``pip install 'dimuon[torchtitan]'``).

Layering: beside the commands. A module here imports ``dimuon.optim`` and its trainer (lazily: only the
module that needs a trainer imports it, and nothing in dimuon imports this package), nothing else of
dimuon.
"""
