"""Token ids -> text as they are generated, never a broken UTF-8 character in between
(IncrementalDecoder; engine.tokenizer.Tokenizer.incremental_decoder picks it or the harmony
decoder of gpt-oss, which streams each message through one of these)."""

from __future__ import annotations

from collections.abc import Sequence

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Streams token ids to text without ever emitting a broken UTF-8 character.

    The approach of HF TextStreamer / vLLM: decode the window ``ids[prefix_offset:]`` and
    the already-emitted part ``ids[prefix_offset:read_offset]``; emit the new suffix only
    when the window's text does not end in U+FFFD (an incomplete character), then slide
    the window. ``push`` returns "" while a character is incomplete; ``flush`` emits
    whatever is held back at the end. The concatenation of all pushes and the flush equals
    ``tokenizer.decode(all_ids, skip_special_tokens)``.

    ``prefix_ids``: optional context ids (e.g. the prompt tail) decoded with the window so
    decoders that treat the first token specially (SentencePiece's leading space) stream
    correctly; their text is not emitted. ``tokenizer``: an engine.tokenizer.Tokenizer (its
    ``decode(ids, skip_special_tokens)``).
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True,
                 prefix_ids: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self._ids: list[int] = [int(i) for i in prefix_ids]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip) if ids else ""

    def push(self, token_id: int) -> str:
        """Add one generated id -> the newly completed text (str, possibly "")."""
        self._ids.append(int(token_id))
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
            delta = new_text[len(prefix_text):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._ids)
            return delta
        return ""

    def flush(self) -> str:
        """End of generation -> the held-back text (may contain U+FFFD for a truncated
        character, exactly as ``decode`` would). Call it once, after the last push."""
        prefix_text = self._decode(self._ids[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset:])
        delta = new_text[len(prefix_text):]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return delta
