"""KV storage formats: one module each, registered by name (see :mod:`kvlib.formats.base`)."""

from kvlib.formats.base import KVFormat, available_formats, get_format, register_format

__all__ = ["KVFormat", "available_formats", "get_format", "register_format"]
