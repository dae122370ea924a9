"""Test set-up: Triton kernels run under the CPU interpreter when no GPU is present."""

import os

# Must be set before triton is first imported anywhere in the test session.
try:
    import torch

    _cuda = torch.cuda.is_available()
except ImportError:  # pragma: no cover
    _cuda = False
if not _cuda:
    os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
