"""Tables that read: column headers in words with units, yes/no for booleans, no negative zero.

Notebooks display pandas frames; :func:`in_words` renames a frame's columns from the short names the code uses to
the words a reader needs (a name missing from :data:`WORDS` and from ``extra`` is kept), and :func:`fixed` is a
number format that never prints ``-0.00`` for a value that rounds to zero.
"""

from __future__ import annotations

from typing import Any

#: short column name -> header in words (with its unit)
WORDS = {
    "B": "batch", "S": "context (tokens)", "ctx": "context (tokens)", "batch": "batch",
    "method": "cache", "ms/step": "step (ms)", "tokens/s": "tokens/s",
    "x DynamicCache": "speed vs DynamicCache (x)", "x StaticCache graph": "speed vs StaticCache graph (x)",
    "attention ms": "attention (ms)", "rest ms": "rest of the step (ms)", "KV GB": "KV (GB)",
    "KV / bf16": "KV bytes / bf16 KV bytes", "peak GB": "peak memory (GB)", "graph": "CUDA graph",
    "decode path": "decode kernel", "write path": "write kernel", "page": "page (positions)",
    "kl_mean": "mean KL", "kl_low": "KL, 95% CI low", "kl_high": "KL, 95% CI high", "kl_max": "max KL",
    "top1": "top-1 agreement", "top5": "top-5 agreement", "bits": "bits per element",
    "seconds": "time (s)", "frac_copy": "fraction of copy bandwidth", "GBps": "bandwidth (GB/s)",
    "ms": "latency (ms)", "speedup": "speedup (x)", "bytes_per_tok_head_side": "bytes / token / head / side",
    "bits_per_element": "bits per element", "kappa_bytes": "bytes per position (all layers)",
    "ctx_max": "longest context (tokens)", "ctx_mean": "mean context (tokens)", "ctx_p90": "context, 90th percentile",
    "mean_response": "mean response (tokens)", "max_len": "longest response (tokens)", "median": "median",
    "sigma": "σ (lognormal)", "byte_ceiling": "byte ceiling (x)", "speedup_over_ceiling": "speedup / byte ceiling",
    "sdpa_bf16_ms": "SDPA bf16 (ms)", "kv4_ms": "KV4 (ms)", "kv4_intpv_ms": "KV4, INT PV (ms)",
    "kv4rl_ms": "KV4-RL (ms)", "kv4_speedup_vs_sdpa": "KV4 speedup vs SDPA (x)", "kv4rl_frac_of_kv4": "KV4-RL / KV4",
    "kv4rl_byte_bound": "KV4-RL byte bound", "kv4_GBps": "KV4 (GB/s)", "sdpa_GBps": "SDPA (GB/s)",
    "torch_ms": "torch (ms)", "triton_ms": "Triton (ms)", "speedup_vs_torch": "speedup vs torch (x)",
    "achieved_GBps": "bandwidth (GB/s)", "fraction_of_copy": "fraction of copy bandwidth", "n_tokens": "tokens",
    "n_out": "outlier channels", "config": "configuration", "group": "group",
}


def header_words(styler: Any, extra: dict[str, str] | None = None) -> Any:
    """``styler`` with its column headers shown in words (:data:`WORDS`, then ``extra``), the frame's own column
    names unchanged (so formats keyed by them still apply)."""
    names = {**WORDS, **(extra or {})}
    return styler.format_index(lambda c: names.get(c, c) if isinstance(c, str) else c, axis=1)


def key_words(key: str) -> str:
    """A result key such as ``kv4_intpv_max_abs_err_o`` in words: "KV4, INT PV: max |Δ| of the output"."""
    import re

    m = re.fullmatch(r"(?P<k>.+?)_(?P<stat>max|mean)_abs_err_(?P<what>o|lse)(?P<rest>.*)", key)
    if not m:
        return key.replace("_", " ")
    kernel = {"kv4": "KV4", "kv4rl": "KV4-RL", "kv4_intpv": "KV4, INT PV", "kv4rl_intpv": "KV4-RL, INT PV"}.get(
        m["k"], m["k"].replace("_", " "))
    what = "the output" if m["what"] == "o" else "the log-sum-exp"
    rest = m["rest"].replace("_", " ").strip()
    return f"{kernel}: {m['stat']} |Δ| of {what}" + (f" ({rest})" if rest else "")


def in_words(df: Any, extra: dict[str, str] | None = None, *, booleans: tuple[str, str] = ("yes", "no"),
             rename: bool = True) -> Any:
    """A copy of ``df`` with headers in words (:data:`WORDS`, then ``extra``; ``rename=False`` keeps them) and
    booleans as yes/no."""
    import pandas as pd

    if not isinstance(df, pd.DataFrame):
        raise TypeError(f"df must be a pandas DataFrame, got {type(df).__name__}")
    import numpy as np

    names = {**WORDS, **(extra or {})}
    out = df.copy()
    for c in out.columns:
        col = out[c]
        if col.dtype == bool or not pd.api.types.is_numeric_dtype(col):  # object and string columns alike
            out[c] = col.map(lambda v: booleans[0 if v else 1] if isinstance(v, (bool, np.bool_))
                             else plain(v) if isinstance(v, str) else v)
    return out.rename(columns={c: names.get(c, c) for c in out.columns}) if rename else out


def fixed(digits: int):
    """A formatter: ``digits`` decimals, a value that rounds to zero printed as 0 (never ``-0.00``), NaN as n/a."""
    import math

    if not isinstance(digits, int) or digits < 0:
        raise ValueError(f"digits must be a non-negative int, got {digits!r}")

    def f(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "n/a"
        try:
            x = round(float(v), digits) + 0.0  # + 0.0 turns -0.0 into 0.0
        except (TypeError, ValueError):
            return str(v)
        return f"{x:,.{digits}f}"

    return f


def signed_percent(digits: int = 1):
    """A formatter: a signed percentage with ``digits`` decimals; a value that rounds to zero is +0.0% (never
    -0.0%), NaN is n/a."""
    import math

    def f(v: Any) -> str:
        if v is None or (isinstance(v, float) and math.isnan(v)):
            return "n/a"
        x = round(float(v) * 100, digits) + 0.0
        return f"{x:+.{digits}f}%"

    return f


def plain(text: str) -> str:
    """A message written for developers, in a reader's words: a missing package named as such (HQQ: it has no
    wheel for this Python), no private attribute names, no note about the wheel folder."""
    import re

    text = re.sub(r"(?:[\w-]+: )?cannot import (\w+): ModuleNotFoundError: No module named '([\w.]+)'",
                  lambda m: f"the {m.group(2)} package is not installed"
                  + (" (it has no wheel for this Python)" if m.group(2) == "hqq" else ""), text)
    text = re.sub(r"ModuleNotFoundError: No module named '([\w.]+)'", r"the \1 package is not installed", text)
    text = re.sub(r"\s*\(no wheels? in [^)]*\)", "", text)
    return re.sub(r"\b[A-Z]\w*\.\w+: ", "", text)  # "Profile.budget_methods: the reason" -> "the reason"
