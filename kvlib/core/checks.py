"""Small argument checks shared by the public API, so every error names its argument."""

from __future__ import annotations

from collections.abc import Sequence

import torch


def check_tensor(
    name: str,
    x: object,
    *,
    ndim: int | Sequence[int] | None = None,
    floating: bool | None = None,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
) -> torch.Tensor:
    """Raise TypeError/ValueError naming ``name`` unless ``x`` is a tensor of the expected kind."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if ndim is not None:
        allowed = (ndim,) if isinstance(ndim, int) else tuple(ndim)
        if x.ndim not in allowed:
            raise ValueError(f"{name} must have {' or '.join(map(str, allowed))} dims, got shape {tuple(x.shape)}")
    if floating is True and not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    if floating is False and x.is_floating_point():
        raise TypeError(f"{name} must be an integer tensor, got {x.dtype}")
    if dtype is not None:
        allowed_dt = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if x.dtype not in allowed_dt:
            raise TypeError(f"{name} must have dtype {' or '.join(map(str, allowed_dt))}, got {x.dtype}")
    return x


def check_group(name: str, group: int, d: int) -> int:
    """A channel group must be a positive integer dividing the head dimension ``d``."""
    if not isinstance(group, int) or isinstance(group, bool):
        raise TypeError(f"{name} must be an int, got {type(group).__name__}")
    if group <= 0 or d % group != 0:
        raise ValueError(f"{name}={group} must be a positive divisor of the head dimension d={d}")
    return group


def check_open_unit(name: str, value: float) -> float:
    """Probabilities such as ``delta`` must lie strictly inside (0, 1)."""
    try:
        v = float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a real number in (0, 1), got {value!r}") from None
    if not 0.0 < v < 1.0:
        raise ValueError(f"{name} must lie in (0, 1), got {value!r}")
    return v


def check_real(name: str, value: object, *, lo: float | None = None, hi: float | None = None,
               allow_inf: bool = False) -> float:
    """A real number (not a bool, not a string) in ``[lo, hi]``, finite unless ``allow_inf`` (NaN never); returned
    as a float."""
    import math
    import numbers

    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__} {value!r}")
    v = float(value)
    if math.isnan(v) or (math.isinf(v) and not allow_inf) or (lo is not None and v < lo) or (hi is not None and v > hi):
        rng = f"[{lo if lo is not None else '-inf'}, {hi if hi is not None else 'inf'}]"
        raise ValueError(f"{name} must be a{'' if allow_inf else ' finite'} number in {rng}, got {value!r}")
    return v


def check_bool(name: str, value: object) -> bool:
    """A bool (``"no"`` is a str, not False)."""
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be True or False, got {type(value).__name__} {value!r}")
    return value


def check_positive_int(name: str, value: int, minimum: int = 1) -> int:
    if not isinstance(value, int) or isinstance(value, bool):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value
