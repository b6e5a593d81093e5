"""The README's test counts stay true: within 20% of what pytest collects here."""
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
FIGURES = re.compile(r"collects\s+about\s+([\d,]+)\s+tests:\s+about\s+([\d,]+)\s+run\b.*?\band\s+about\s+([\d,]+)\s+"
                     r"that\s+need\s+a\s+GPU\s+skip", re.S)


def _collected(*args) -> int:
    r = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                       cwd=REPO, capture_output=True, text=True, timeout=600)
    m = re.search(r"(\d+)(?:/\d+)? tests? collected", r.stdout)
    assert m, r.stdout[-2000:] + r.stderr[-2000:]
    return int(m.group(1))


def readme_figures(text: str) -> tuple[int, int, int]:
    m = FIGURES.search(text)
    assert m, "README.md: the sentence with the test counts ('collects about N tests: about R run ... and " \
              "about G that need a GPU skip') is gone"
    return tuple(int(g.replace(",", "")) for g in m.groups())


def test_the_figures_sentence_is_read():
    assert readme_figures("pytest collects\nabout 1,650 tests: about 600 run (x, y,\nand z) and about 1,050 that "
                          "need a\nGPU skip") == (1650, 600, 1050)
    with pytest.raises(AssertionError):
        readme_figures("about 260 tests")


@pytest.mark.skipif(importlib.util.find_spec("torch") is None,
                    reason="the README's counts are for the documented setup, with torch (its tests are collected)")
def test_readme_counts_are_within_20_percent():
    total, run, gpu = readme_figures((REPO / "README.md").read_text())
    from conftest import COLLECTED

    if COLLECTED:   # (this run collected the whole suite: its counts, without collecting again)
        got_total, got_gpu = COLLECTED["total"], COLLECTED["gpu"]
    else:
        got_total, got_gpu = _collected(), _collected("-m", "gpu")
    for name, said, got in (("collected", total, got_total), ("run without a GPU", run, got_total - got_gpu),
                            ("that need a GPU", gpu, got_gpu)):
        assert abs(said - got) <= 0.2 * got, f"README.md says about {said} tests {name}; pytest finds {got}"
