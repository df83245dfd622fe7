"""Key -> bytes storage under one root URL: a local directory, ``memory://`` or ``s3://``.

``base`` holds the contract every backend keeps (read it before writing one), the
``WrapperStore`` base of fault-injecting or recording views, and the scheme registry
(``register_scheme``) that ``Store.from_url`` opens URLs through; ``local``, ``memory`` and ``s3``
are the backends, each registering its schemes when imported: this package imports them all, so
importing any part of it knows every scheme. ``ckptlib.testing.store_contract.StoreContract`` is
the test kit a new backend subclasses.
"""

from .base import (
                   SUPPORTED_URLS,
                   TMP_PREFIX,
                   ObjectInfo,
                   Store,
                   StoreCapabilities,
                   WrapperStore,
                   check_key,
                   check_prefix,
                   open_store,
                   redact_url,
                   register_scheme,
)
from .local import LocalStore
from .memory import MemoryStore
from .s3 import S3Store

__all__ = ["Store", "StoreCapabilities", "ObjectInfo", "WrapperStore", "LocalStore", "MemoryStore", "S3Store",
           "SUPPORTED_URLS", "TMP_PREFIX", "check_key", "check_prefix", "open_store", "redact_url",
           "register_scheme"]
