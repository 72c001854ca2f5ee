"""dimuon: fast Muon-family optimizers for diffusion transformers.

Layers (imports only point down; ``tests/unit/test_layers.py`` checks every edge):

- ``dimuon.cli``: ``dimuon train | sample | eval | bench``, loading each command lazily;
- the commands ``dimuon.train``, ``dimuon.eval`` and ``dimuon.bench`` (which may also drive the other two);
- the building blocks ``dimuon.metrics`` (may import data and dit), ``dimuon.dit`` and ``dimuon.data``;
- the low level: ``dimuon.io`` (files and runs), ``dimuon.log`` (rank-aware logging) and
  ``dimuon.optim``, the product, which imports nothing else of dimuon.
"""

# The package's one version, a plain string literal: setuptools reads it from this file at build time
# (pyproject.toml's [tool.setuptools.dynamic]), so the wheel's metadata and ``dimuon --version`` agree.
__version__ = "0.1.0"
