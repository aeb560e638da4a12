"""cdbench: simulation and benchmarking harness for constrained-decoding schedulers."""

from cdbench import _env

_env.configure()

__version__ = "0.1.0"
