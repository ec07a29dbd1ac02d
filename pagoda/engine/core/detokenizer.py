"""Incremental detokenization with stop strings.

Decoding token by token breaks multi-byte characters split over tokens and drops the space
that SentencePiece tokenizers attach to a word's first piece. So each step decodes a short
window of tokens twice, with and without the new ones, and emits the difference; the window
starts with a few prompt tokens for context:

    tokens:  [ prompt tail | out0 out1 ... ]
               ^prefix_offset       ^read_offset
    new text = decode(tokens[prefix:]) - decode(tokens[prefix:read])
    (held back while it ends in U+FFFD, an incomplete UTF-8 sequence)

Stop strings are searched in the text added plus the len(stop) - 1 characters before it, so
a stop split over tokens is found. Text that could still be the start of a stop string is
held back from streaming until it is known not to be one.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

PROMPT_CONTEXT_TOKENS = 6
REPLACEMENT_CHAR = "\ufffd"


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: PreTrainedTokenizerBase,
        prompt_token_ids: list[int],
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = list(stop or [])
        self.include_stop_str_in_output = include_stop_str_in_output
        self.tokens = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self.prefix_offset = 0
        self.read_offset = len(self.tokens)
        self.output_text = ""
        self.num_emitted_chars = 0
        self.stop_string: str | None = None
        # Characters kept back from streaming: a possible partial stop string.
        self.holdback = max((len(s) for s in self.stop), default=1) - 1
        if include_stop_str_in_output:
            self.holdback = 0

    def _decode(self, token_ids: list[int]) -> str:
        return self.tokenizer.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Add sampled tokens; returns the stop string if one now appears in the text."""
        self.tokens.extend(new_token_ids)
        prefix_text = self._decode(self.tokens[self.prefix_offset : self.read_offset])
        full_text = self._decode(self.tokens[self.prefix_offset :])
        if full_text.endswith(REPLACEMENT_CHAR) or len(full_text) < len(prefix_text):
            return None  # wait for the rest of a multi-byte character
        added = full_text[len(prefix_text) :]
        self.prefix_offset, self.read_offset = self.read_offset, len(self.tokens)
        if not added:
            return None
        search_start = max(0, len(self.output_text) - max((len(s) for s in self.stop), default=0) + 1)
        self.output_text += added
        return self._find_stop(search_start)

    def _find_stop(self, search_start: int) -> str | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, search_start)
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.stop_string = stop
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet handed out, minus a held-back possible stop-string prefix."""
        end = len(self.output_text) if finished else max(
            self.num_emitted_chars, len(self.output_text) - self.holdback
        )
        delta = self.output_text[self.num_emitted_chars : end]
        self.num_emitted_chars = end
        return delta
