"""Where dataset files live: local paths or URLs (``s3://``, ``gs://``, ``http(s)://``, ``file://``).

``locations.py`` tells paths and URLs apart and shows URLs without credentials; ``options.py``
is a dataset's ``storage_options`` (credentials, retries, timeouts); ``store.py``'s ``Storage``
reads bytes through obstore (``_obstore*.py``) or fsspec (``_fsspec_retry.py``) with them.
"""

from .locations import basename, is_remote, is_url, join, local_path, parent, read_local, safe_url
from .options import SECRET_KEYS, StorageOptions, fsspec_options
from .store import Storage, StorageError, describe, local_copy

__all__ = ["SECRET_KEYS", "Storage", "StorageError", "StorageOptions", "basename", "describe", "fsspec_options",
           "is_remote", "is_url", "join", "local_copy", "local_path", "parent", "read_local", "safe_url"]
