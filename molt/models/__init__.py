"""Model folders: a name or path in, a local Hugging Face folder out (resolve.py), and the
conversions that make the built-in models (smollm2.py, upcycle.py, vlm.py)."""

from molt.models.resolve import (DEFAULT_MODEL, default_cache_dir, export_path, folder_size_bytes,
                                 prepare, resolve_model)

__all__ = ["DEFAULT_MODEL", "default_cache_dir", "export_path", "folder_size_bytes", "prepare",
           "resolve_model"]
