"""asv benchmarks of cukern: one module per kernel family (bench_norm.py, ...), each the cases
of that family from ``cukern._bench`` (the table behind ``python -m cukern bench``) as
``track_`` metrics measured on the GPU with CUDA events.

asv runs each benchmark in a fresh process and, in 0.6, takes the PYTHONPATH entries back out
of ``sys.path`` there; the checkout that holds these benchmarks is put first on ``sys.path``
here so that they measure this commit's cukern, not an installed one.
"""
import sys
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
if (_ROOT / "cukern" / "__init__.py").is_file() and str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))
