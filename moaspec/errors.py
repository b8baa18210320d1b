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


def brief(exc: BaseException, limit: int = 300) -> str:
    """A library's multi-line error message as one line, shortened: for a :class:`MoaspecError` that quotes it."""
    text = " ".join(str(exc).split())
    return text if len(text) <= limit else text[: limit - 1] + "…"
