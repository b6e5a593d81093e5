"""The dry run's stand-ins (no GPU): a kernel that is never compiled and the exception that
stops a call where its launch plan would run. A module of their own, without pytest or
hypothesis, so that tools/sanitize.py's processes (tests/sanitize_cases.py's dry run) import
them without paying for those at each start; conftest re-exports both."""
from __future__ import annotations


class DryRun(Exception):
    """Raised where a launch plan would run: ``plan`` holds it (fix-ups, allocations, steps)."""

    def __init__(self, plan):
        super().__init__("dry run")
        self.plan = plan


class FakeKernel:
    """A kernel instance that is never compiled: its signature is read from the source, and
    ``prepare`` packs the arguments against it as a real launch does (so a front's arguments
    are checked by name, C type and dtype on the CPU)."""

    def __init__(self, inst, device):
        from cukern import _kernels

        self.instance, self.device = inst, device
        self.signature = _kernels.signature(inst)

    def resident_blocks(self, threads=None):
        return 132 * 4

    def prepare(self, grid, block=None, **args):
        from cukern import _kernels

        dtypes = args.pop("dtypes", {})
        layout, values, slots = _kernels.pack(self.signature, self.instance.name, args, dtypes)
        return ("launch", self.instance, grid, block, dict(zip(self.signature.names, values)), slots)
