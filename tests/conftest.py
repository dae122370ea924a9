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
# The store of model computations (kvlib.hf.memo): a fresh one per session, so tests never read what an earlier
# run left in ~/.cache/kvlib (and leave nothing there).
if "KVLIB_MODEL_CACHE" not in os.environ:
    import tempfile

    os.environ["KVLIB_MODEL_CACHE"] = tempfile.mkdtemp(prefix="kvlib-model-cache-")


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smol():
    """The shipped SmolLM2 model and tokenizer, loaded once per test session (skipped if absent)."""
    from kvlib.hf import model as kvmodel

    if not kvmodel.model_available():
        pytest.skip(f"SmolLM2 GGUF absent; install with: {kvmodel.install_command()}")
    return kvmodel.load_model()
