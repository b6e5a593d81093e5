"""The docs speak to the project's users, with no GPU: README.md, CHANGELOG.md and docs/*.md
carry measurements, dates, commits, GPUs and versions, in the voice of an engineering log, and
no account of where or how the work was done (sessions, reviewing agents, an offline "GPU host"
and its output folder, scratch scripts outside the repository, machines lent or time that ran
out, what to run "next time", numbers of an issue tracker users cannot see)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# Each pattern (matched case-insensitively) with what to write instead.
_PATTERNS = [
    (r"\bsessions?\b", "a date or a commit, or 'in the same run'"),
    (r"\bgpu[- ]hosts?\b", "'the H200 machine', 'a GPU machine', or the versions it runs"),
    (r"\boffline (?:gpu )?(?:host|machine)s?\b", "'a GPU machine without network access'"),
    (r"\.gpurun\b", "'an uncommitted probe script', or what it did"),
    (r"\$OUT\b", "the log directory (LOG_DIR)"),
    (r"\bgpu_host_run\b", "tools/gpu_check.sh"),
    # ("issue 57", "issues #4"; not the verb: "issues 19% fewer instructions", "issues 4 x 300")
    (r"\bissues? #?\d+\b(?!%| ?[x×]\b|\.\d| \w*instruction)", "what the issue was about"),
    (r"(?<![\w`&])#\d{2,}\b", "what the issue was about"),
    (r"\b(?:the|an?) (?:\w+ )?issue's\b|\bwhat the issues? asks?\b|\bthe \w+ issue\b(?! (?:phase|slots?|order|rate))",
     "'the target', or what the issue was about"),
    (r"\bnext time\b", "what remains to be tried"),
    (r"\blent\b", "the GPU and the date"),
    (r"\bavailable machines?\b", "the GPU and the date"),
    (r"\bdevice time\b", "what was not measured"),
    (r"\btracker\b", "what the issue was about"),
    (r"\b(?:time|budget) ran out\b", "what was not measured"),
    (r"\bran out of (?:time|budget)\b", "what was not measured"),
    (r"\bhelpers? (?:read|reading|review|reviewed|reviewing|modell?ed|found|ran|checked)\b",
     "'Review (date)'"),
    (r"\breview helpers?\b", "'Review (date)'"),
]
PATTERNS = [(re.compile(p, re.IGNORECASE), why) for p, why in _PATTERNS]


def doc_files() -> list[Path]:
    files = [REPO / "README.md", REPO / "CHANGELOG.md", *sorted((REPO / "docs").glob("*.md"))]
    return [f for f in files if f.is_file()]


def scan(text: str, where: str) -> list[str]:
    """``where:line: 'phrase' (write instead: ...)`` for every match of PATTERNS in ``text``."""
    hits = []
    for number, line in enumerate(text.splitlines(), 1):
        for pattern, why in PATTERNS:
            for m in pattern.finditer(line):
                hits.append(f"{where}:{number}: {m.group(0)!r} (write instead: {why})")
    return hits


@pytest.mark.parametrize("path", doc_files(), ids=lambda p: str(p.relative_to(REPO)))
def test_docs_speak_to_users(path: Path):
    hits = scan(path.read_text(encoding="utf-8"), str(path.relative_to(REPO)))
    assert not hits, "lines about how the work was done, not about the project:\n" + "\n".join(hits)


def test_the_docs_are_found():
    names = {p.relative_to(REPO).as_posix() for p in doc_files()}
    assert {"README.md", "docs/development.md", "docs/notes-attention.md"} <= names


@pytest.mark.parametrize("line", [
    "- v2 (2026-11-22, second session): the fused kernel.",
    "Lesson: compute-sanitizer is on the GPU host only.",
    "Measured with `.gpurun/waves.py` (one process).",
    "Logs go to $OUT.",
    "Fixed in issue 57; see also #57.",
    "As issue #12 reported.",
    "Against the issue's target (1.5x torch): met.",
    "The targets of the embedding issue are met.",
    "Next time, measure d64 first.",
    "The H100 was not lent that day; device time ran out.",
    "A second review helper modelled the index arithmetic.",
    "A helper reading the code found two bugs.",
    "Not measured: the budget ran out.",
    "Run it on an offline GPU host.",
])
def test_scan_catches_a_planted_line(line: str):
    text = "# Notes\n\nA clean line: 4.25 ms on an H200 (897643a, 2026-11-22).\n" + line + "\n"
    hits = scan(text, "sample.md")
    assert hits and all(h.startswith("sample.md:4: ") for h in hits), hits


@pytest.mark.parametrize("line", [
    "`--budget` seconds (560 by default): tools still running then are stopped.",
    "the epilogue, ptxas ran out of registers. Not measured.",
    "Device helpers shared by the families are in `cuda_src/common/`.",
    "The two-pass kernel shares the helpers: 16000 classes 0.448 -> 0.436 ms.",
    "`MINB` sets ptxas's register budget; the host queues the calls ahead of the device.",
    "Review (2026-11-22): two bugs found in the backward.",
    "Measured with an uncommitted probe script on the H200 machine (CUDA 13.0).",
    "`tools/gpu_check.sh` writes its logs to the log directory (LOG_DIR, default ./gpu-out).",
    "The `#1` row of the table; `&#8212;` as an entity.",
    "A 128-key tile issues 19% fewer instructions; it issues 4 x 300 instructions a step.",
    "The issue phase is mostly wgmma; the single producer thread's TMA issue; stalls per issue.",
])
def test_scan_passes_a_clean_line(line: str):
    assert scan(line, "sample.md") == []
