"""What a kernel family declares, in one place, so that the rest of cukern discovers it.

A family module or package (``cukern/rope.py``, ``cukern/norm/``, ...) ends with
``FAMILY = Family(...)``; its name in ``cukern._registry.FAMILIES`` is the one line that
registers it. From the declaration:

* ``cukern`` exports its array functions, ``cukern.reference`` its NumPy references;
* the NVRTC compile check compiles every kernel instance it declares (``instances``);
* ``python -m cukern bench`` and asv run its cases (``bench``, ``torch_bench``);
* ``cukern.torch`` builds its custom ops, the eager autograd Functions, the drop-ins for
  ``torch.nn.functional`` that ``patch()`` installs, the nn modules and any functions of its
  own (``torch_ops``, ``dropins``, ``modules``, ``torch_api``).

Nothing here imports torch or CuPy: the declarations are plain data and functions, and the
functions import what they need when they run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

__all__ = ["Family", "TorchOp", "DropIn", "ModuleSpec"]


@dataclass(frozen=True)
class TorchOp:
    """One op under autograd, written once; ``cukern.torch`` makes of it both the custom op
    ``torch.ops.cukern.<name>`` (with its fake, for torch.compile) and the lean eager
    ``torch.autograd.Function`` that calls the array functions directly.

    forward(*inputs) -> tuple of tensors: the ``visible`` outputs the caller gets, then the
    statistics the backward needs (never differentiated). ``inference(*inputs)``, when given,
    computes the visible output alone (no statistics) for calls that need no gradient.
    save(inputs, outputs) -> (tensors to save, state) for the backward;
    backward_args(saved, state, grads, T) -> the arguments of ``backward`` (``T`` is
    ``cukern.torch._tools``: autocast, determinism); backward(*args) -> a tuple of gradients,
    None where there is none, the i-th going to input ``grads_to[i]`` (or to each input of a
    tuple there: one gradient for several inputs, as x and the residual of h = x + residual). ``schema`` and
    ``backward_schema`` are the custom ops' schemas; ``fake`` and ``backward_fake`` their
    shapes for torch.compile. No backward changes a tensor it is given, with one exception:
    ``donating_backward``, when given, may write its gradients into the saved buffers the
    forward made for it (a gradient computed ahead, scaled in place). The eager paths run it
    only where autograd will not read the saved tensors again (the graph is not retained;
    ``cukern.torch._tools.saved_used_once``) and ``backward`` otherwise, as the custom op always
    does (its outputs must not alias its inputs). ``native``: its plans
    depend on nothing but its arguments and ``torch.use_deterministic_algorithms`` (read when
    the forward runs), so the eager path may record them on a signature's first call and
    replay them from C++ after (cukern/torch/_native.py).
    """
    name: str
    schema: str
    forward: Callable
    fake: Callable
    save: Callable
    backward_schema: str
    backward: Callable
    backward_fake: Callable
    backward_args: Callable
    grads_to: tuple[int | tuple[int, ...], ...]
    visible: int = 1
    inference: Callable | None = None
    donating_backward: Callable | None = None
    native: bool = False


@dataclass(frozen=True)
class DropIn:
    """A function of ``torch.nn.functional`` that ``cukern.torch.patch()`` replaces.

    route(T, *args, **kwargs) takes the function's own arguments and returns either a string
    (why cukern does not take this call: PyTorch's function runs, and the reason is counted)
    or ``(op, args, post)``: the TorchOp to run on ``args`` and a function applied to its
    visible output (a reshape back, say; None for none). ``compile``: route the call inside
    torch.compile too, where it was measured faster than what Inductor makes of the same code
    (docs/torch.md); otherwise compiled graphs keep PyTorch's function. ``probe(f, x)``
    calls PyTorch's function ``f`` on a tiny (2, 4, 2, 8) tensor: how ``cukern.torch`` learns
    which dtype autocast gives the op (it follows the installed PyTorch); None when autocast
    does not apply. ``min_size``: calls smaller than this (in the units the route measures:
    elements of the input, say) go to PyTorch, counted as "small": there the step waits for
    the host, and PyTorch's C++ dispatch costs less host time than cukern's Python one while
    the kernels have almost nothing to save (measured: docs/torch.md). ``patch(min_size=0)``
    routes them too.
    """
    replaces: str
    route: Callable
    compile: bool = True
    probe: Callable | None = None
    min_size: int = 0


@dataclass(frozen=True)
class ModuleSpec:
    """A drop-in nn module: a subclass of ``torch.nn.<base>`` with the same constructor,
    parameters and state_dict, whose forward calls the drop-in ``functional`` with
    ``args(module, input)``.

    ``options``: (name, default) pairs the constructor also takes, keyword-only (variants
    that ``torch.nn.<base>`` lacks; kept as attributes of the same names). With any of them
    not at its default the forward is ``variant(T, ops, module, input)`` (T: cukern.torch._tools,
    ops: the TorchOps by name, as ``Family.torch_api`` gets them), and ``init(module)`` runs
    once after the base constructor (the parameters' start values for the variant)."""
    name: str
    base: str
    functional: str
    args: Callable
    options: tuple = ()
    variant: Callable | None = None
    init: Callable | None = None


@dataclass(frozen=True)
class Family:
    """A kernel family: its name (the same in cuda_src/, cukern/, tests/, docs/), its public
    array functions, references, kernel instances, benchmark cases and PyTorch bindings."""
    name: str
    api: tuple[Callable, ...]
    references: dict[str, Callable]
    instances: Callable[[], list]
    bench: Callable[[bool], list] | None = None
    torch_bench: Callable[[bool], list] | None = None
    torch_ops: tuple[TorchOp, ...] = ()
    dropins: tuple[DropIn, ...] = ()
    modules: tuple[ModuleSpec, ...] = ()
    # torch_api(T, ops, modules) -> {name: function or nn.Module class} that cukern.torch exports
    # beside the drop-ins (functions with no torch.nn.functional counterpart); T is
    # cukern.torch._tools, ops the built TorchOps by name (each callable eagerly, .compiled inside
    # torch.compile), modules the drop-in module classes by name. A family never imports
    # cukern.torch itself (it sits below it).
    torch_api: Callable | None = None
