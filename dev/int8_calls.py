"""The INT8 probes' variants as decode_int8 calls: tuning names go into one Int8KernelConfig.

A probe's variant is ``(flags, keywords)``; ``flags`` name the kernels' former module switches (``VAR_DOT``,
``PV_DEQUANT``, ``AHEAD``, ...) as recorded in the probes' result files, ``keywords`` mix request
arguments (``cert``, ``impl``, ``num_splits``) with tuning (``block_n``, ``num_warps``, ``skip_philox``, ...).
:func:`as_call` sorts them (:func:`kvlib.kernels.int8.config.config_call`): every tuning name becomes a field
of the call's ``config``; nothing is set on a kernel module.
"""

from __future__ import annotations

from typing import Any

from kvlib.kernels.int8.config import CONFIG_FIELDS, config_call

#: former module flags of kvlib.kernels.int8.h10 / gluon -> Int8KernelConfig fields
FLAG_FIELDS = {"TILE_SUMS": "tile_sums", "WIDE_MUL": "wide_mul", "VAR_DOT": "var_dot", "MAXNREG": "maxnreg",
               "PV_DEQUANT": "pv_dequant", "AHEAD": "ahead", "PROGRAMS_PER_SM": "programs_per_sm"}


def as_call(kw: dict[str, Any], flags: dict[str, Any] | None = None) -> dict[str, Any]:
    """``kw`` with its tuning names (and ``flags``) moved into ``config=``."""
    tune = {FLAG_FIELDS.get(k, k): v for k, v in (flags or {}).items()}
    unknown = set(tune) - CONFIG_FIELDS
    if unknown:
        raise TypeError(f"flags name no Int8KernelConfig field: {sorted(unknown)}")
    return config_call(tune | kw)


def decode(*args: Any, flags: dict[str, Any] | None = None, **kw: Any):
    """:func:`kvlib.kernels.int8.decode.decode_int8` of a probe variant (see :func:`as_call`)."""
    from kvlib.kernels.int8.decode import decode_int8

    return decode_int8(*args, **as_call(kw, flags))


def stage1(*args: Any, flags: dict[str, Any] | None = None, **kw: Any):
    """:func:`kvlib.kernels.int8.decode.decode_stage1` of a probe variant (see :func:`as_call`)."""
    from kvlib.kernels.int8.decode import decode_stage1

    return decode_stage1(*args, **as_call(kw, flags))
