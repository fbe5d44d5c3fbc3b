"""The KV-cache keyword matches what the installed transformers' forwards take."""

from __future__ import annotations

import warnings

import torch
from transformers import DynamicCache

from draftheads.compat import cache_kwargs


def test_the_cache_is_passed_under_the_installed_name_without_a_warning(tiny_llama):
    """The cache fills (the forward used it) and no deprecation warning is raised: a stale name
    either warns (5.24 to 5.39) or is ignored or refused (5.40 on)."""
    cache = DynamicCache(config=tiny_llama.config)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tiny_llama(torch.tensor([[1, 2, 3]]), **cache_kwargs(cache), use_cache=True)
        tiny_llama(torch.tensor([[4]]), **cache_kwargs(cache), use_cache=True)
    assert cache.get_seq_length() == 4
