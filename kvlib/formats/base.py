"""The small interface every KV format implements, and the registry that names them.

A format turns one (layer, kv_head, side) stream of vectors ``x [S, d]`` into a packed object and
back. The HF ``Cache`` adapter (``kvlib.hf.cache``) is written once over this interface, so a new
format is one new module: subclass :class:`KVFormat`, decorate with :func:`register_format`.

Context passed to ``write`` as keywords (a format ignores what it does not need):
``layer`` (int), ``kv_head`` (int), ``side`` (0 = keys, 1 = values), ``slots`` (int64 ``[S]``,
stable storage addresses, used by dithered formats as Philox counters), ``positions`` (int64
``[S]``, sequence positions, used by formats with position-dependent state such as a sink/recent
side buffer or a full-precision residual window), ``seed`` (int).
Stateful formats (side buffers, residual windows) keep their state in the packed object returned
by ``write`` and accept it back through ``append(packed, x, **ctx)``; stateless formats get a
default ``append`` that concatenates along the token axis.
"""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch

_REGISTRY: dict[str, type[KVFormat]] = {}


class KVFormat(ABC):
    """One KV storage format: write, read, and an exact byte account per position."""

    name: ClassVar[str] = ""
    #: keyword options the constructor accepts, for error messages and docs
    options: ClassVar[tuple[str, ...]] = ()

    # Capabilities: what the cache, the certificate, the gate and the book need to know about a format,
    # declared here once (no table elsewhere repeats them).
    #: sub-Gaussian proxy of the key residual (a key of kvlib.certify.bound.PROXY: "dither", "sr"), or None
    #: when the format's error has no such proxy (then it cannot be certified)
    variance_proxy: ClassVar[str | None] = None
    #: True when an old position's representation can change as tokens are appended (side buffers,
    #: residual windows): such a format overrides append() and is re-read whole
    stateful: ClassVar[bool] = False
    #: True when write() is a deterministic function of x alone (no dither, no random rounding), so the
    #: gate can bound |x - read(write(x))| from the stored bytes
    deterministic: ClassVar[bool] = False
    #: the decode-kernel family that reads this format's packed pool ("int8", "int4", "bf16"), or None
    #: when only the torch reference path reads it
    kernel: ClassVar[str | None] = None

    @abstractmethod
    def write(self, x: torch.Tensor, **ctx: Any) -> Any:
        """Pack ``x [S, d]`` (float) into this format's storage object."""

    @abstractmethod
    def read(self, packed: Any) -> torch.Tensor:
        """Return the float32 ``[S, d]`` reconstruction of ``packed``."""

    @abstractmethod
    def bytes_per_position(self, d: int) -> float:
        """Bytes stored per token per head per side (codes + scales + side data), from the layout."""

    def append(self, packed: Any, x: torch.Tensor, **ctx: Any) -> Any:
        """Add new tokens to an existing packed object (default: write and concatenate)."""
        new = self.write(x, **ctx)
        if packed is None:
            return new
        return concat_packed(packed, new)

    def nbytes(self, packed: Any) -> int:
        """Bytes actually allocated by ``packed`` (measured from its tensors, not assumed)."""
        return tensor_nbytes(packed)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


def tensor_nbytes(obj: Any) -> int:
    """Sum of ``nbytes`` over every tensor reachable in ``obj`` (dataclass, dict, list, tensor)."""
    if isinstance(obj, torch.Tensor):
        return obj.numel() * obj.element_size()
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return sum(tensor_nbytes(getattr(obj, f.name)) for f in dataclasses.fields(obj))
    if isinstance(obj, dict):
        return sum(tensor_nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(tensor_nbytes(v) for v in obj)
    return 0


def concat_packed(a: Any, b: Any) -> Any:
    """Concatenate two packed dataclasses along the token axis (dim 0) field by field.

    Tensor fields whose first dim is the token count are concatenated; other fields (metadata,
    per-head constants such as outlier channel sets) must agree and are kept from ``a``.
    """
    if not (dataclasses.is_dataclass(a) and dataclasses.is_dataclass(b)):
        raise TypeError("concat_packed needs two packed dataclasses; stateful formats must override append()")
    out = {}
    for f in dataclasses.fields(a):
        va, vb = getattr(a, f.name), getattr(b, f.name)
        if f.metadata.get("per_token", False):
            out[f.name] = None if va is None else torch.cat([va, vb], dim=0)
        else:
            out[f.name] = va
    return type(a)(**out)


def packed_len(p: Any) -> int:
    """Number of tokens held by a packed dataclass (first per-token field's length)."""
    for f in dataclasses.fields(p):
        if f.metadata.get("per_token", False) and getattr(p, f.name) is not None:
            return int(getattr(p, f.name).shape[0])
    raise ValueError(f"{type(p).__name__} has no per-token field")


def per_token(**kw: Any) -> Any:
    """Dataclass field marker: this tensor's dim 0 is the token axis (concatenated on append)."""
    return dataclasses.field(metadata={"per_token": True}, **kw)


def register_format(name: str) -> Callable[[type[KVFormat]], type[KVFormat]]:
    """Class decorator adding a format to the registry under ``name``."""

    def deco(cls: type[KVFormat]) -> type[KVFormat]:
        if name in _REGISTRY and _REGISTRY[name] is not cls:
            raise ValueError(f"format name {name!r} is already registered by {_REGISTRY[name].__name__}")
        cls.name = name
        overrides_append = cls.append is not KVFormat.append
        if overrides_append != cls.stateful:
            raise TypeError(f"format {name!r}: stateful={cls.stateful} but append() is "
                            f"{'overridden' if overrides_append else 'inherited'}; declare stateful=True exactly "
                            "when old positions can change (and override append)")
        _REGISTRY[name] = cls
        return cls

    return deco


def _load_all() -> None:
    # Import every module of kvlib.formats so their @register_format decorators run.
    import importlib
    import pkgutil

    import kvlib.formats as pkg

    for mod in pkgutil.iter_modules(pkg.__path__):
        if mod.name != "base":
            importlib.import_module(f"kvlib.formats.{mod.name}")


def format_class(name: str) -> type[KVFormat]:
    """The class registered as ``name`` (its capabilities are class attributes)."""
    _load_all()
    if not isinstance(name, str):
        raise TypeError(f"format must be a str, got {type(name).__name__}")
    if name not in _REGISTRY:
        raise ValueError(f"unknown format {name!r}; available formats: {', '.join(sorted(_REGISTRY))}")
    return _REGISTRY[name]


def capabilities(name: str) -> dict[str, Any]:
    """The declared capabilities of format ``name`` (variance_proxy, stateful, deterministic, kernel)."""
    cls = format_class(name)
    return {k: getattr(cls, k) for k in ("variance_proxy", "stateful", "deterministic", "kernel")}


def available_formats() -> list[str]:
    """Names of the registered KV formats, sorted."""
    _load_all()
    return sorted(_REGISTRY)


def get_format(name: str, **options: Any) -> KVFormat:
    """Instantiate the format registered as ``name`` with ``options``."""
    cls = format_class(name)
    try:
        return cls(**options)
    except TypeError as e:
        raise TypeError(f"format {name!r} accepts options {cls.options}: {e}") from None
