"""dimuon: fast Muon-family optimizers for diffusion transformers."""

__version__ = "0.1.0"
