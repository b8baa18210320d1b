"""User-facing errors.

Everything a user can get wrong (paths, prompts, options, files) raises a
:class:`MoaspecError` whose message is one complete sentence; the CLI prints it
on one line and exits non-zero instead of showing a traceback.
"""


class MoaspecError(Exception):
    """An error caused by input, files or configuration, explained in its message."""


class ModelLoadError(MoaspecError):
    """A model directory is missing, incomplete, or of an unsupported architecture."""


class PromptError(MoaspecError):
    """A prompt is empty or does not fit the model's context window."""


def brief(exc: BaseException | str, limit: int = 300) -> str:
    """A library's multi-line error message (or an exception's) as one line, shortened: for a
    :class:`MoaspecError` that quotes it."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"


ECHO_CHARS = 40  # of a value a user sent, quoted in an error message


def encodable(text: str) -> str:
    """``text`` with lone surrogates written as escapes (``\\ud800``): JSON may carry them, UTF-8 may not."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def shown(value: object) -> str:
    """``value`` as an error message may quote it: at most ``ECHO_CHARS`` characters, always encodable.

    A server's error must not grow with its input, nor fail to encode it. An integer too long to be
    a token id is described, not written out (Python refuses to write one of over 4,300 digits).
    """
    if isinstance(value, int) and value.bit_length() > 64:
        return f"<an integer of {value.bit_length()} bits>"
    text = encodable(str(value))
    return text if len(text) <= ECHO_CHARS else f"{text[:ECHO_CHARS]}… ({len(text)} characters)"
