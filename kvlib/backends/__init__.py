"""One backend per kernel family: the only code that knows both a format and a kernel.

A format names its family on its class (``kernel``: ``"int8"``, ``"int4"``, ``"bf16"`` or None, see
:mod:`kvlib.formats.base`); :func:`backend_class` maps it to that family's backend, which allocates the pages,
writes and reads them, and runs the decode kernels over them (as vLLM's attention backends do, one class each):

* :class:`~kvlib.backends.int8.Int8Backend`: dither-int8 and rtn-int8 (:mod:`kvlib.kernels.int8`);
* :class:`~kvlib.backends.int4.Int4Backend`: kv4 and kv4rl (:mod:`kvlib.kernels.int4`, :mod:`kvlib.kernels.write`);
* :class:`~kvlib.backends.plain.PlainBackend`: bf16, fp16, fp32 (:mod:`kvlib.kernels.bf16`);
* :class:`~kvlib.backends.reference.ReferenceBackend` and :class:`~kvlib.backends.reference.ObjectBackend`: every
  other format, and a family's format with options its kernels do not read (the torch reference path).

The interface (:class:`~kvlib.backends.base.Backend`) is what :mod:`kvlib.hf.cache` speaks to: allocate and grow;
write; read, copy slots, select rows, crop; ``supports(shape, device)``; ``decode(...) -> Step(o, path,
certificate)``. Below the backends, :mod:`kvlib.storage` holds only the memory layout (page tables, the INT8 page
contract) and :mod:`kvlib.kernels` the kernels, neither knowing the other's callers.
"""

from __future__ import annotations

from typing import Any

from kvlib.backends.base import REFERENCE, Backend, Step, step_addresses
from kvlib.backends.int4 import Int4Backend
from kvlib.backends.int8 import Int8Backend
from kvlib.backends.plain import PlainBackend
from kvlib.backends.reference import ObjectBackend, ReferenceBackend
from kvlib.formats.base import KVFormat

__all__ = ["FAMILIES", "REFERENCE", "Backend", "Int4Backend", "Int8Backend", "ObjectBackend", "PlainBackend",
           "ReferenceBackend", "Step", "backend_class", "step_addresses"]

#: a format's declared ``kernel`` family -> its backend
FAMILIES: dict[str, type[Backend]] = {"int8": Int8Backend, "int4": Int4Backend, "bf16": PlainBackend}


def backend_class(key_format: KVFormat, value_format: KVFormat, *, outlier_table: Any = None) -> type[Backend]:
    """The backend of a (key, value) format pair: the family both formats declare (their ``kernel``), where that
    backend takes their options (:meth:`Backend.takes`); else the reference backend (:class:`ObjectBackend` for a
    stateful format)."""
    family = type(key_format).kernel
    cls = FAMILIES.get(family) if family is not None and type(value_format).kernel == family else None
    if cls is not None and cls.takes(key_format, value_format, outlier_table) is None:
        return cls
    if type(key_format).stateful or type(value_format).stateful:
        return ObjectBackend
    return ReferenceBackend
