"""When a sequence stops: end-of-sequence and stop token ids, stop strings, and its length limit.

Token ids stop as ``transformers``' ``eos_token_id`` does: the stop token is the last one kept. Stop
strings stop as ``transformers``' ``stop_strings`` do for the tokens (the token that completes the
string is the last one kept) and as vLLM and the OpenAI API do for the text (it ends before the
string). Speculative decoding emits several tokens per step, so every token of a step is checked in
order and the step is cut at the first that stops.

Each sequence ends for one reason (``FINISH_REASONS``, the OpenAI API's names plus two): ``eos`` an
end-of-sequence token, ``stop`` a stop token id or stop string, ``length`` max_new_tokens, and
``context`` the base model's context (its positions) is full.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

FINISH_REASONS = ("eos", "stop", "length", "context")


@dataclass(frozen=True)
class StopRule:
    """What ends a sequence besides its length: token ids (EOS included) and strings. The
    ``eos_ids`` among ``token_ids`` end it as ``eos``, the others as ``stop``."""

    token_ids: frozenset[int] = frozenset()
    strings: tuple[str, ...] = ()
    eos_ids: frozenset[int] = frozenset()

    def __post_init__(self):
        for string in self.strings:
            if not isinstance(string, str) or not string:
                raise ValueError(f"stop strings must be non-empty strings, got {string!r}")

    def cut(
        self, previous: Sequence[int], new: Sequence[int], room: int, tokenizer=None
    ) -> tuple[list[int], str | None]:
        """The part of ``new`` to keep after ``previous`` (the sequence's new tokens so far) and why
        the sequence ends, None while it goes on: cut after the first stop token (``eos`` or
        ``stop``), after the token completing a stop string (``stop``), and at ``room`` tokens
        (``length``; the caller knows whether the room was max_new_tokens' or the context's)."""
        new = list(new)
        for index, token in enumerate(new):
            if token in self.token_ids:
                new = new[: index + 1]
                break
        stopped_by_string = False
        if self.strings:
            stop_at = self._string_stop(previous, new, tokenizer)
            if stop_at is not None:
                new, stopped_by_string = new[: stop_at + 1], True
        if len(new) > room:  # the room ends first
            return new[:room], "length"
        if stopped_by_string:
            return new, "stop"
        if new and new[-1] in self.token_ids:
            return new, "eos" if new[-1] in self.eos_ids else "stop"
        return new, "length" if len(new) >= room else None

    def _string_stop(self, previous: Sequence[int], new: Sequence[int], tokenizer) -> int | None:
        """Index in ``new`` of the token whose text completes a stop string, or None."""
        if tokenizer is None:
            raise ValueError("stop strings need a tokenizer: SpeculativeGenerator(..., tokenizer=)")
        longest = max(len(s) for s in self.strings)
        seen = len(tokenizer.decode(list(previous), skip_special_tokens=True))
        for index in range(len(new)):
            text = tokenizer.decode(list(previous) + new[: index + 1], skip_special_tokens=True)
            window = text[max(0, seen - longest + 1) :]  # a string may straddle the earlier text
            if any(s in window for s in self.strings):
                return index
        return None

    def trim_text(self, text: str) -> str:
        """The text before the first stop string (vLLM's and the OpenAI API's convention)."""
        positions = [text.find(s) for s in self.strings if s in text]
        return text[: min(positions)] if positions else text
