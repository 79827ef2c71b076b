"""Zephon's online loader: deterministic, elastic global batches from lane-sharded data.

Importing this package is cheap and does not import torch; the PyTorch pieces live in
:mod:`loader.integrations.torch_data`.
"""

__version__ = "0.1.0"
