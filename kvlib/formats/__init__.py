"""KV storage formats: one module each, registered by name (see :mod:`kvlib.formats.base`)."""

from kvlib.formats.base import (
    CAPABILITIES,
    KVFormat,
    available_formats,
    capabilities,
    format_class,
    format_table,
    formats_where,
    get_format,
    register_format,
    registered_format,
    unregister_format,
)

__all__ = ["CAPABILITIES", "KVFormat", "available_formats", "capabilities", "format_class", "format_table",
           "formats_where", "get_format", "register_format", "registered_format", "unregister_format"]
