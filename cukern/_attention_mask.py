"""Which keys a query of attention sees, and how its scores are capped: the causal mask, sliding
windows and the softcap, as the kernels' fronts, the NumPy references and the tests read them.

Queries and keys are aligned at the bottom right (query i's own position among the keys is
``i + sk - sq``, as for the causal mask). A window ``(left, right)`` (flash-attn's
``window_size``) lets query i see key j when ``i + sk - sq - left <= j <= i + sk - sq + right``;
-1 leaves that side unbounded. ``causal`` is the window ``(-1, 0)``, and with a window it sets the
right side to 0 (flash-attn does the same). A side wide enough that no query's bound falls
inside the keys (left >= sk - 1, right >= sq - 1) is unbounded: the same keys, and the kernels
skip the bound. (flash-attn takes right >= sk as unbounded, which hides fewer keys than its
documented bound when sq > sk; cukern keeps to the bound.)

``softcap`` c > 0 replaces each score s (after ``softmax_scale``) by ``c * tanh(s / c)``
(Gemma 2's logit softcapping); 0 or None leaves the scores as they are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from . import _checks

__all__ = ["Mask", "mask_of", "visible", "key_range", "capped", "softcap_grad", "softcap_log2"]


@dataclass(frozen=True)
class Mask:
    """The normalized mask of one call: ``left`` and ``right`` keys around the diagonal (-1:
    unbounded), and ``softcap`` (0: none)."""
    left: int = -1
    right: int = -1
    softcap: float = 0.0

    @property
    def causal(self) -> bool:
        """The plain causal mask: nothing after the diagonal, everything before it."""
        return self.left < 0 and self.right == 0

    @property
    def windowed(self) -> bool:
        """Some side is bounded other than by the causal mask alone."""
        return self.left >= 0 or self.right > 0

    @property
    def kind(self) -> int:
        """The kernels' MASK template argument: 0 none, 1 causal, 2 a window (common/attn_mask.cuh)."""
        return 2 if self.windowed else 1 if self.causal else 0

    @property
    def any(self) -> bool:
        """Any key may be hidden from some query."""
        return self.left >= 0 or self.right >= 0


def _window(window) -> tuple[int, int]:
    try:
        left, right = window
    except (TypeError, ValueError):
        raise TypeError(f"window: expected (left, right), two ints >= -1 (-1: unbounded), got {window!r}") from None
    left, right = _checks.index(left, "window[0]"), _checks.index(right, "window[1]")
    for name, side in (("window[0]", left), ("window[1]", right)):
        if side < -1:
            raise ValueError(f"{name}: must be >= -1 (-1: unbounded), got {side}")
    return left, right


def _softcap(softcap) -> float:
    # (the kernels take c log2(e) as a float32: a normal float32 there too)
    return _checks.softcap(softcap, log2e=True)


def mask_of(causal, window, softcap, sq: int, sk: int) -> Mask:
    """The Mask of a call's ``causal``, ``window`` and ``softcap`` for ``sq`` queries and ``sk``
    keys (packed documents: the longest of each); a side too wide to hide a key is unbounded."""
    left, right = _window((-1, -1) if window is None else window)
    if causal:
        right = 0
    left = -1 if left >= max(sk - 1, 0) else left
    right = -1 if right >= max(sq - 1, 0) else right
    return Mask(left, right, _softcap(softcap))


def visible(mask: Mask, sq: int, sk: int) -> np.ndarray:
    """(sq, sk) bool: query i sees key j."""
    j = np.arange(sk)[None, :]
    pos = np.arange(sq)[:, None] + (sk - sq)
    keep = np.ones((sq, sk), dtype=bool)
    if mask.right >= 0:
        keep &= j <= pos + mask.right
    if mask.left >= 0:
        keep &= j >= pos - mask.left
    return keep


def key_range(mask: Mask, row0: int, rows: int, sq: int, sk: int) -> tuple[int, int]:
    """The keys ``[first, stop)`` that any of the queries ``row0 .. row0 + rows - 1`` sees (the
    kernels take the key tiles that meet it, and skip the others); ``first >= stop`` when none."""
    last_row = min(row0 + rows, sq) - 1
    first = 0 if mask.left < 0 else max(0, row0 + sk - sq - mask.left)
    stop = sk if mask.right < 0 else min(sk, last_row + sk - sq + mask.right + 1)
    return first, stop


def capped(s: np.ndarray, mask: Mask) -> np.ndarray:
    """The scores after the softcap (``s`` already scaled)."""
    return mask.softcap * np.tanh(s / mask.softcap) if mask.softcap else s


def softcap_grad(s: np.ndarray, mask: Mask) -> np.ndarray:
    """d capped(s) / d s."""
    if not mask.softcap:
        return np.ones_like(s)
    t = np.tanh(s / mask.softcap)
    return 1.0 - t * t


def softcap_log2(mask: Mask, scale: float) -> tuple[float, float]:
    """What the kernels take for the softcap: the scale into tanh's argument (scale / c) and
    the factor out of it in the log2 domain (c * log2(e)); (0, 0) without it."""
    if not mask.softcap:
        return 0.0, 0.0
    _checks.positive_float32(scale / mask.softcap, "softcap (softmax_scale / softcap)")
    return scale / mask.softcap, mask.softcap * math.log2(math.e)
