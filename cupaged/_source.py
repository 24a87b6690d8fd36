"""CUDA source text read without a C++ parser: the comments taken out, so that a regular expression
over the rest cannot match inside them (the kernels' shape comments hold commas, angle brackets and
code-like text). A leaf: the sim reads kernel parameter names with it, and the host reads the
constants it mirrors from the CUDA source."""

from __future__ import annotations

import re

__all__ = ["strip_comments"]

_COMMENT_OR_LITERAL = re.compile(r'//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|\'(?:\\.|[^\'\\\n])*\'', re.S)


def strip_comments(code: str) -> str:
    """``code`` with every comment replaced by a space (string and character literals kept)."""
    return _COMMENT_OR_LITERAL.sub(lambda m: m.group(0) if m.group(0)[0] in "\"'" else " ", code)
