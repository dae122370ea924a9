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

Everything a consumer needs to know about a format lives on its class, and nowhere else: the
capabilities (:data:`CAPABILITIES`: ``variance_proxy``, ``stateful``, ``deterministic``, ``bounded``,
``kernel``; :func:`capabilities`, :func:`formats_where`) and the byte account (``bytes_per_position``,
``fixed_bytes``, ``capacity``, ``side_count``, ``bits_per_element``). :func:`register_format` refuses
declarations that contradict the methods (``stateful`` vs ``append``, ``bounded`` vs ``error_bound``) or
name an unknown kernel or proxy. :func:`format_table` is the book's table of them.
"""

from __future__ import annotations

import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator
from typing import Any, ClassVar

import torch

from kvlib.core.checks import check_group, check_tensor

_REGISTRY: dict[str, type[KVFormat]] = {}
#: the decode-kernel families a format may name as its ``kernel`` (None: torch reference path only)
KERNELS = (None, "int8", "int4", "bf16")
#: the capability attributes every format declares on its class (see :class:`KVFormat`)
CAPABILITIES = ("variance_proxy", "stateful", "deterministic", "bounded", "kernel")
#: the residual laws a format may declare as its ``variance_proxy``: the per-channel sub-Gaussian proxy of the
#: key residual divided by ``s^2`` (subtractive uniform dither 1/12, stochastic rounding 1/4). What a law implies
#: for a score is :func:`variance_proxy`, which the certificate (:mod:`kvlib.certify.bound`) calls.
PROXY = {"dither": 1.0 / 12.0, "sr": 1.0 / 4.0}


def outlier_index(outlier_channels: torch.Tensor | None, d: int) -> torch.Tensor | None:
    """``outlier_channels`` (channel indices in ``[0, d)``, kept in fp16 and not quantised) as int64, checked."""
    if outlier_channels is None:
        return None
    check_tensor("outlier_channels", outlier_channels, floating=False)
    if outlier_channels.numel() and (int(outlier_channels.min()) < 0 or int(outlier_channels.max()) >= d):
        raise ValueError(f"outlier_channels must lie in [0, {d}), got values outside")
    return outlier_channels.to(torch.int64)


def variance_proxy(
    q: torch.Tensor,
    scales: torch.Tensor,
    *,
    sm_scale: float,
    group: int = 32,
    outlier_channels: torch.Tensor | None = None,
    proxy: str = "dither",
) -> torch.Tensor:
    """``varsigma_t^2 = sm_scale^2 * proxy * sum_c q_c^2 s_{c,t}^2`` in float64, shape ``[..., S]``.

    ``q`` ``[..., d]``; ``scales`` ``[S, d // group]`` or ``[..., S, d // group]`` (broadcast
    against ``q``'s leading dims). Outlier channels (stored in fp16, not dithered) are left out.
    ``proxy``: ``"dither"`` (uniform residual, 1/12) or ``"sr"`` (stochastic rounding, 1/4).
    """
    check_tensor("q", q, floating=True)
    check_tensor("scales", scales, floating=True)
    if q.ndim < 1:
        raise ValueError("q must have at least one dim [..., d]")
    if scales.ndim < 2:
        raise ValueError(f"scales must have shape [S, d // group] or [..., S, d // group], got {tuple(scales.shape)}")
    if proxy not in PROXY:
        raise ValueError(f"proxy must be one of {sorted(PROXY)}, got {proxy!r}")
    d = q.shape[-1]
    check_group("group", group, d)
    if scales.shape[-1] != d // group:
        raise ValueError(f"scales must have last dim d // group = {d // group}, got shape {tuple(scales.shape)}")
    q2 = q.to(torch.float64).square()
    oc = outlier_index(outlier_channels, d)
    if oc is not None and oc.numel():
        keep = torch.ones(oc.shape[:-1] + (d,), dtype=torch.float64, device=q.device)
        keep.scatter_(-1, oc, 0.0)
        q2 = q2 * keep
    qg = q2.reshape(q2.shape[:-1] + (d // group, group)).sum(-1)  # [..., ng]
    s2 = scales.to(torch.float64).square()  # [..., S, ng]
    var = (qg.unsqueeze(-2) * s2).sum(-1)  # [..., S]
    return (sm_scale**2) * PROXY[proxy] * var


class KVFormat(ABC):
    """One KV storage format: write, read, and an exact byte account per position."""

    name: ClassVar[str] = ""
    #: keyword options the constructor accepts, for error messages and docs
    options: ClassVar[tuple[str, ...]] = ()

    # Capabilities: what the cache, the certificate, the gate and the book need to know about a format,
    # declared here once (no table elsewhere repeats them).
    #: sub-Gaussian proxy of the key residual (a key of :data:`PROXY`: "dither", "sr"), or None
    #: when the format's error has no such proxy (then it cannot be certified)
    variance_proxy: ClassVar[str | None] = None
    #: True when an old position's representation can change as tokens are appended (side buffers,
    #: residual windows): such a format overrides append() and is re-read whole
    stateful: ClassVar[bool] = False
    #: True when write() is a deterministic function of x alone (no dither, no random rounding), so the
    #: gate can bound |x - read(write(x))| from the stored bytes
    deterministic: ClassVar[bool] = False
    #: the decode-kernel family that reads this format's packed pool ("int8", "int4", "bf16"), or None
    #: when only the torch reference path reads it. It names the format's backend (:mod:`kvlib.backends`: the pages
    #: and kernels of that family, which say which of the format's options they read); nothing else matches names
    kernel: ClassVar[str | None] = None
    #: True when :meth:`error_bound` gives a sound elementwise bound on ``|x - read(write(x))|`` from the
    #: packed data alone (what the gate's worst-case certificate needs); only deterministic formats can
    bounded: ClassVar[bool] = False
    #: positions held by a fixed per-stream side buffer (KV4-RL's sinks + recent window), 0 when none;
    #: its bytes are :meth:`fixed_bytes`
    capacity: int = 0
    #: True when write() reads nothing of its context but ``side`` (no layer, head, slot or seed: no dither, no
    #: random rounding) and works per token: a store may then write and read every head of a token as one batch
    #: of rows (the same bytes as head by head)
    batch_heads: ClassVar[bool] = False
    #: the largest element magnitude the format stores faithfully (fp16 scales, offsets or values overflow past
    #: it); :meth:`representable` checks it
    max_abs: ClassVar[float] = float("inf")

    def representable(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        """bool ``x.shape[:-1]``: which vectors of ``x [..., d]`` (one token of one head each) the format stores
        faithfully: finite, and within :attr:`max_abs` of what it quantises (a rotated stream: after rotation).
        Elementwise, no host sync; the cache isolates the vectors that are not (zeroed and their row flagged)."""
        y = self._stored_view(x, side)
        a = y.abs().amax(-1)  # NaN propagates through the max
        lim = self.max_abs
        if y.is_floating_point():  # one comparison: finite and within range (NaN compares False)
            lim = min(lim, torch.finfo(y.dtype).max)
        return a <= lim

    def surely_representable(self, x: torch.Tensor, side: int = 0) -> torch.Tensor:
        """A cheaper sufficient test: True only where :meth:`representable` is True (a rotating format bounds the
        rotation instead of computing it); False says nothing. Default: :meth:`representable` itself."""
        return self.representable(x, side)

    def _stored_view(self, x: torch.Tensor, side: int) -> torch.Tensor:
        """What the format quantises of ``x`` (a rotating format overrides: the rotated vector)."""
        return x

    @abstractmethod
    def write(self, x: torch.Tensor, **ctx: Any) -> Any:
        """Pack ``x [S, d]`` (float) into this format's storage object."""

    @abstractmethod
    def read(self, packed: Any) -> torch.Tensor:
        """Return the float32 ``[S, d]`` reconstruction of ``packed``."""

    @abstractmethod
    def bytes_per_position(self, d: int) -> float:
        """Bytes stored per token per head per side (codes + scales + side data), from the layout."""

    def fixed_bytes(self, d: int) -> float:
        """Bytes per stream that do not grow with its length (a side buffer of :attr:`capacity` slots); 0 here."""
        return 0.0

    def side_count(self, lengths: torch.Tensor) -> torch.Tensor:
        """Positions of streams of ``lengths`` held in the side buffer (read from there, not the main
        region) at the next decode step; zeros for formats without one."""
        return torch.zeros_like(lengths.long())

    def bits_per_element(self, d: int) -> float:
        """``8 bytes_per_position(d) / d``: stored bits per K or V element, metadata included."""
        return 8.0 * self.bytes_per_position(d) / d

    def error_bound(self, packed: Any, x_hat: torch.Tensor) -> torch.Tensor:
        """Elementwise float64 bound ``E [S, d]`` on ``|x_hat - x|`` from one stream's ``packed`` data and its
        reconstruction ``x_hat = read(packed)``; formats with ``bounded = True`` implement it."""
        raise NotImplementedError(f"format {self.name!r} declares no deterministic error bound (bounded=False)")

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


def register_format(name: str, *, replace: bool = False) -> Callable[[type[KVFormat]], type[KVFormat]]:
    """Class decorator adding a format to the registry under ``name``. ``replace``: a class already registered
    under ``name`` gives way (a notebook cell that defines a format, run again); without it, a name taken by another
    class is refused."""
    if not isinstance(replace, bool):
        raise TypeError(f"replace must be a bool, got {type(replace).__name__}")

    def deco(cls: type[KVFormat]) -> type[KVFormat]:
        if name in _REGISTRY and _REGISTRY[name] is not cls and not replace:
            raise ValueError(f"format name {name!r} is already registered by {_REGISTRY[name].__name__} "
                             "(register_format(name, replace=True) replaces it)")
        cls.name = name
        overrides_append = cls.append is not KVFormat.append
        if overrides_append != cls.stateful:
            raise TypeError(f"format {name!r}: stateful={cls.stateful} but append() is "
                            f"{'overridden' if overrides_append else 'inherited'}; declare stateful=True exactly "
                            "when old positions can change (and override append)")
        overrides_bound = cls.error_bound is not KVFormat.error_bound
        if overrides_bound != cls.bounded or (cls.bounded and not cls.deterministic):
            raise TypeError(f"format {name!r}: bounded={cls.bounded}, deterministic={cls.deterministic} but "
                            f"error_bound() is {'overridden' if overrides_bound else 'inherited'}; declare "
                            "bounded=True exactly when a deterministic format implements error_bound")
        if cls.kernel not in KERNELS:
            raise TypeError(f"format {name!r}: kernel must be one of {KERNELS}, got {cls.kernel!r}")
        if cls.variance_proxy is not None and cls.variance_proxy not in PROXY:
            raise TypeError(f"format {name!r}: variance_proxy must be None or one of {sorted(PROXY)}, "
                            f"got {cls.variance_proxy!r}")
        if cls.variance_proxy is not None and cls.deterministic:
            raise TypeError(f"format {name!r}: a variance proxy describes a random residual; "
                            "a deterministic format cannot declare one")
        _REGISTRY[name] = cls
        return cls

    return deco


def unregister_format(name: str) -> type[KVFormat]:
    """Remove ``name`` from the registry and return its class (for formats defined outside kvlib, e.g. in a
    test); the built-in formats are re-registered only by re-importing their modules, so leave them be."""
    if name not in _REGISTRY:
        raise ValueError(f"format {name!r} is not registered")
    return _REGISTRY.pop(name)


@contextlib.contextmanager
def registered_format(name: str, cls: type[KVFormat]) -> Iterator[type[KVFormat]]:
    """Within the block, ``cls`` is registered as ``name`` (checked as :func:`register_format` does)."""
    register_format(name)(cls)
    try:
        yield cls
    finally:
        unregister_format(name)


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
    """The declared capabilities of format ``name`` (:data:`CAPABILITIES`: variance_proxy, stateful,
    deterministic, bounded, kernel)."""
    cls = format_class(name)
    return {k: getattr(cls, k) for k in CAPABILITIES}


def formats_where(**want: Any) -> list[str]:
    """Sorted names of the registered formats whose capabilities equal ``want`` (e.g. ``deterministic=True``)."""
    bad = set(want) - set(CAPABILITIES)
    if bad:
        raise ValueError(f"unknown capabilities {sorted(bad)}; known: {CAPABILITIES}")
    return [n for n in available_formats() if all(getattr(_REGISTRY[n], k) == v for k, v in want.items())]


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


def format_table(d: int = 128, names: list[Any] | None = None, *, n_tokens: int = 256,
                 seed: int = 0) -> list[dict[str, Any]]:
    """One row per format: its declared capabilities and byte account at head dim ``d``, beside the bytes
    measured from a packed write of ``n_tokens`` random positions (``(nbytes - fixed_bytes) / n_tokens``;
    ``n_tokens`` should be a multiple of every format's block or residual window, as the default 256 is).

    ``names``: format names or ``(name, options)`` pairs (default: every registered format, default
    options). The book's format tables read this, so a newly registered format appears in them.
    """
    if isinstance(d, bool) or not isinstance(d, int) or d < 1:
        raise ValueError(f"d must be a positive int, got {d!r}")
    if isinstance(n_tokens, bool) or not isinstance(n_tokens, int) or n_tokens < 1:
        raise ValueError(f"n_tokens must be a positive int, got {n_tokens!r}")
    x = torch.randn(n_tokens, d, generator=torch.Generator().manual_seed(seed))
    ctx = dict(layer=0, kv_head=0, side=0, seed=seed, slots=torch.arange(n_tokens), positions=torch.arange(n_tokens))
    rows = []
    for entry in available_formats() if names is None else list(names):
        if isinstance(entry, str):
            name, opts = entry, {}
        elif isinstance(entry, tuple) and len(entry) == 2 and isinstance(entry[0], str):
            name, opts = entry[0], dict(entry[1])
        else:
            raise TypeError(f"names: each entry must be a format name or a (name, options) pair, got {entry!r}")
        f = get_format(name, **opts)
        measured = (f.nbytes(f.write(x, **ctx)) - f.fixed_bytes(d)) / n_tokens
        rows.append({"format": name, "options": opts, **capabilities(name),
                     "bytes_per_position": float(f.bytes_per_position(d)), "bits_per_element": f.bits_per_element(d),
                     "fixed_bytes": float(f.fixed_bytes(d)), "capacity": int(f.capacity),
                     "measured_bytes_per_position": float(measured)})
    return rows
