"""The shape of the CUDA sources under kernels_cu/, read as text (no compile): a family file stays its header and
includes, every source file and every kernel stays small enough to read in one sitting, and the attention
kernels' logit step (softcap, ALiBi, the online-softmax rescale) is written once, in attention/logits.cuh (the
factor e^{x - m} in softmax.cuh, which the merges share), so a change to it reaches every kernel."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

KERNELS = Path(__file__).resolve().parent.parent / "kernels_cu"
FAMILY_FILE_LINES = 400  # paged_attention.cu: the family's header (maths, layouts, versions) and its includes
SOURCE_FILE_LINES = 450  # any .cu / .cuh, the Hopper files to come included
# A kernel (a __global__ function, signature to closing brace) of ~100 lines; 110 leaves room for a parameter or
# two more in a signature that already takes ~12 lines, not for another loop: that goes into a __device__ helper.
KERNEL_LINES = 110

# Each piece of the logit step: where it lives, and a pattern no other source may hold (comments aside).
ONE_PLACE = {
    "softcap (c tanh(x / c))": ("attention/logits.cuh", r"\btanhf\s*\("),
    "ALiBi's distance |key - pos|": ("attention/logits.cuh", r"\bfabsf\s*\(\s*float\s*\("),
    "e^{x - m}, 0 for x = -inf (the online-softmax rescale's factor)":
        ("softmax.cuh", r"==\s*neg_inf\s*\(\s*\)\s*\?\s*0\.0f\s*:\s*expf\s*\("),
}
LOGIT_STEP_USERS = ("decode.cuh", "decode_mma.cuh", "prefill.cuh", "mla_decode.cuh")


def _sources() -> list[Path]:
    return sorted(p for p in KERNELS.rglob("*") if p.suffix in (".cu", ".cuh"))


def _name(path: Path) -> str:
    return path.relative_to(KERNELS).as_posix()


def code_only(text: str) -> str:
    """``text`` with its comments and the insides of its string and character literals blanked (newlines kept:
    line numbers hold), so neither a brace nor a pattern in them counts."""
    def blank(m: re.Match) -> str:
        x = m.group(0)
        inside = re.sub(r"[^\n]", " ", x[1:-1])
        return x[0] + inside + x[-1] if x[0] in "\"'" else re.sub(r"[^\n]", " ", x)

    return re.sub(r"""//[^\n]*|/\*.*?\*/|"(?:\\.|[^"\\\n])*"|'(?:\\.|[^'\\\n])*'""", blank, text, flags=re.S)


def kernel_spans(text: str) -> list[tuple[str, int, int]]:
    """(name, first line, last line) of every __global__ function defined in ``text``: from the line of
    ``__global__`` to that of the brace closing its body."""
    code, spans = code_only(text), []
    for m in re.finditer(r"\b__global__\b", code):
        head_end = re.search(r"[{;]", code[m.end():])
        if head_end is None or head_end.group(0) == ";":  # a declaration
            continue
        start = m.end() + head_end.start()
        head = re.sub(r"__launch_bounds__\s*\((?:[^()]|\([^()]*\))*\)", " ", code[m.end():start])
        name = re.search(r"(\w+)\s*\(", head)
        depth, i = 0, start
        for i in range(start, len(code)):
            depth += {"{": 1, "}": -1}.get(code[i], 0)
            if depth == 0:
                break
        spans.append((name.group(1) if name else "?", code.count("\n", 0, m.start()) + 1,
                      code.count("\n", 0, i) + 1))
    return spans


def logit_step_copies(texts: dict[str, str]) -> list[str]:
    """Every place a piece of the logit step is written outside its one file, as 'piece: file (n times)'."""
    found = []
    for piece, (home, pattern) in ONE_PLACE.items():
        counts = {name: len(re.findall(pattern, code_only(text))) for name, text in texts.items()}
        if counts.get(home) != 1 or sum(counts.values()) != 1:
            found += [f"{piece}: {name} ({n} times)" for name, n in counts.items() if n and (name != home or n > 1)]
            found += [f"{piece}: missing from {home}"] if not counts.get(home) else []
    return found


def test_the_family_file_is_its_header_and_includes():
    lines = (KERNELS / "paged_attention.cu").read_text(encoding="utf-8").count("\n")
    assert lines <= FAMILY_FILE_LINES, f"paged_attention.cu has {lines} lines (cap {FAMILY_FILE_LINES})"
    assert not kernel_spans((KERNELS / "paged_attention.cu").read_text(encoding="utf-8")), \
        "paged_attention.cu defines a kernel: kernels live in their own attention/*.cuh"


@pytest.mark.parametrize("path", _sources(), ids=_name)
def test_source_file_within_its_cap(path):
    lines = path.read_text(encoding="utf-8").count("\n")
    assert lines <= SOURCE_FILE_LINES, f"{_name(path)} has {lines} lines (cap {SOURCE_FILE_LINES}): split it by concern"


@pytest.mark.parametrize("path", _sources(), ids=_name)
def test_every_kernel_within_its_cap(path):
    long = [f"{name}: lines {a}-{b} ({b - a + 1})" for name, a, b in kernel_spans(path.read_text(encoding="utf-8"))
            if b - a + 1 > KERNEL_LINES]
    assert not long, f"{_name(path)}: kernels over {KERNEL_LINES} lines:\n" + "\n".join(long)


def test_the_logit_step_is_written_once():
    texts = {_name(p): p.read_text(encoding="utf-8") for p in _sources()}
    assert not logit_step_copies(texts), "\n".join(logit_step_copies(texts))
    for name in LOGIT_STEP_USERS:  # paged_decode_kernel composes pa_logit's two steps itself (logits.cuh says why)
        code = code_only(texts[f"attention/{name}"])
        assert re.search(r"\bpa_(logit|alibi)\(", code) and "pa_rescale(" in code, \
            f"attention/{name} does not take the shared logit step"


def test_the_checks_catch_what_they_guard():
    """The parser and checks on made-up sources: a long kernel (braces in comments and strings ignored), a
    declaration (no body), and a second copy of softcap."""
    body = "\n".join(f"  x += {i};" for i in range(KERNEL_LINES))
    text = ("template <class T>\n__global__ void __launch_bounds__(128, (2)) long_kernel(T* x) {  // {\n"
            f"{body}\n  const char* s = \"}}\";\n}}\n__global__ void declared(float*);\n"
            "__global__ void short_kernel() { /* } */ }\n")
    spans = kernel_spans(text)
    assert [(n, b - a + 1) for n, a, b in spans] == [("long_kernel", KERNEL_LINES + 3), ("short_kernel", 1)]
    copies = logit_step_copies({"attention/logits.cuh": "x = c * tanhf(x / c); fabsf(float(d));",
                                "softmax.cuh": "return x == neg_inf() ? 0.0f : expf(x - m);",
                                "attention/prefill.cuh": "y = c * tanhf(y / c);  // tanhf( in a comment"})
    assert copies == ["softcap (c tanh(x / c)): attention/prefill.cuh (1 times)"]
