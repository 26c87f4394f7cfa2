"""GPT-2's reversible map between bytes and printable unicode characters.

GPT-2 stores its vocabulary and merges as text. Every byte value is shown as one printable
character: the printable Latin-1 bytes stand for themselves, and the others (control bytes,
space, the soft hyphen, ...) are shifted to code points 256 and above, so a space is ``Ġ``
and a newline ``Ċ``. A token's text form is the concatenation of its bytes' characters.

>>> token_to_text(b" the")
'Ġthe'
>>> text_to_token("Ġthe")
b' the'
"""

from __future__ import annotations


def _byte_to_char() -> list[str]:
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table = [""] * 256
    shifted = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + shifted)
            shifted += 1
    return table


BYTE_TO_CHAR: list[str] = _byte_to_char()
CHAR_TO_BYTE: dict[str, int] = {char: byte for byte, char in enumerate(BYTE_TO_CHAR)}

# str.translate tables: latin-1 decoding maps each byte to chr(byte); these map on to GPT-2's
# characters and back, so whole tokens convert in C.
_TO_TEXT = {byte: char for byte, char in enumerate(BYTE_TO_CHAR)}
_FROM_TEXT = {ord(char): chr(byte) for byte, char in enumerate(BYTE_TO_CHAR)}


def token_to_text(token: bytes) -> str:
    """The GPT-2 text form of a token's bytes."""
    return token.decode("latin-1").translate(_TO_TEXT)


def text_to_token(text: str) -> bytes:
    """The bytes of a token written in GPT-2 text form; ValueError if a character is not in the map."""
    try:
        token = text.translate(_FROM_TEXT).encode("latin-1")
    except UnicodeEncodeError:
        token = None
    # A character outside the map (a plain space, say) would pass through translate unchanged:
    # the round trip catches it.
    if token is None or token_to_text(token) != text:
        raise ValueError(f"{text!r} is not in GPT-2's byte-to-unicode form")
    return token
