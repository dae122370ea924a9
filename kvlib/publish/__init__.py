"""The book's machinery: the notebook-side :class:`Run`, the papermill runner and the assembler."""

from kvlib.publish.run import Run, fmt
from kvlib.publish.verdicts import load_claims

__all__ = ["Run", "fmt", "load_claims"]
