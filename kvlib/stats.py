"""The API page's public path for the statistics (``kvlib.stats.paired_bootstrap_ci``, ``kvlib.stats.mcnemar``).

They live in :mod:`kvlib.analysis.stats`, beside the analyses that use them; this module re-exports them.
"""

from kvlib.analysis.stats import *  # noqa: F403
from kvlib.analysis.stats import __all__  # noqa: F401
