"""From sampled token ids to the text a stream shows: stop on EOS, a stop string or the token budget."""

from __future__ import annotations

from collections.abc import Collection, Sequence


class TextStream:
    """One answer being generated. :meth:`push` each sampled token; it returns the text the token adds
    (``None`` when it adds nothing visible yet) and sets :attr:`finish_reason` once generation must end.

    A trailing partial UTF-8 sequence is held back until the next token completes it; a stop string ends
    the answer and is cut from it.
    """

    def __init__(self, tokenizer, eos_ids: Collection[int], stop: Sequence[str], max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
        self.tokenizer = tokenizer
        self.eos_ids = eos_ids
        self.stop = stop
        self.max_tokens = max_tokens
        self.token_ids: list[int] = []
        self.finish_reason: str | None = None  # "stop" (EOS or stop string) or "length" once finished
        self._emitted = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def push(self, token: int) -> str | None:
        """Take the next sampled token; returns the new visible text, if any."""
        if self.finished:
            raise RuntimeError("push() after the answer has finished")
        if token in self.eos_ids:
            self.finish_reason = "stop"
            return None
        self.token_ids.append(token)
        text = self.tokenizer.decode(self.token_ids, skip_special_tokens=True)
        cut = first_stop(text, self.stop)
        if cut is not None:
            text, self.finish_reason = text[:cut], "stop"
        elif len(self.token_ids) >= self.max_tokens:
            self.finish_reason = "length"
        piece = None
        if cut is not None or not text.endswith("\ufffd"):
            if len(text) > len(self._emitted):
                piece = text[len(self._emitted) :]
            self._emitted = text
        return piece

    @property
    def text(self) -> str:
        """The answer so far: what was shown when a stop ended it, else all generated tokens decoded."""
        if self.finish_reason == "stop":
            return self._emitted
        return self.tokenizer.decode(self.token_ids, skip_special_tokens=True)


def first_stop(text: str, stops: Sequence[str]) -> int | None:
    """Index of the earliest stop string in ``text``, or None."""
    hits = [text.find(s) for s in stops if s and s in text]
    return min(hits) if hits else None
