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


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol():
    """The shipped SmolLM2 model and tokenizer, loaded once per test session (skipped if absent)."""
    from kvlib.hf import model as kvmodel

    if not kvmodel.model_available():
        pytest.skip(f"SmolLM2 GGUF absent; install with: {kvmodel.install_command()}")
    return kvmodel.load_model()
