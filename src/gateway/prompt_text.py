"""Request text to token ids, refusing text that no tokenizer can take.

JSON can carry a lone UTF-16 surrogate ("\\ud800"), which Python keeps in a str
but which has no UTF-8 form: the Rust tokenizers then fail with an unrelated
TypeError. Checking the text first turns that into a client error that says
where the bad character is.
"""

from __future__ import annotations

from typing import Any


class UnencodableText(ValueError):
    """Text that cannot be tokenised; `param` names the request field it came from."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


def check_text(text: str, param: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        bad = text[exc.start]
        raise UnencodableText(
            f"{param} is not valid Unicode text: a lone surrogate U+{ord(bad):04X} at character {exc.start}",
            param,
        ) from None


def encode(tokenizer: Any, text: str, param: str, add_special_tokens: bool = True) -> list[int]:
    """Token ids of `text`; UnencodableText when it has no UTF-8 form."""
    check_text(text, param)
    return list(tokenizer.encode(text, add_special_tokens=add_special_tokens))
