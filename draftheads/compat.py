"""Keyword names that differ between the transformers releases this package supports (5.x).

transformers 5.24 renamed the cache argument of every model, decoder-layer and attention forward
from ``past_key_values`` to ``cache``; the old name still works there but warns on every call, and
its removal is announced for 5.40. Earlier 5.x releases take only ``past_key_values``. Every
forward this package calls with a KV cache passes it through ``cache_kwargs``.
"""

from __future__ import annotations

import functools

CACHE_RENAMED_IN = "5.24.0"  # the first transformers release whose forwards take ``cache=``


@functools.cache
def cache_argument() -> str:
    """The name of the KV-cache keyword of the installed transformers' forwards."""
    import transformers
    from packaging.version import Version

    return "cache" if Version(transformers.__version__) >= Version(CACHE_RENAMED_IN) else "past_key_values"


def cache_kwargs(cache) -> dict:
    """``{name: cache}``, for a transformers forward's keyword arguments."""
    return {cache_argument(): cache}
