#!/usr/bin/env python3
"""Every kernel family under NVIDIA compute-sanitizer: memcheck, initcheck, racecheck, synccheck.

    python3 tools/sanitize.py                       # all four tools, every family; logs in $OUT or ./sanitize-out
    python3 tools/sanitize.py --tools memcheck,initcheck --family attention --family rope
    python3 tools/sanitize.py --list                # the cases (no GPU needed)

The cases are tests/sanitize_cases.py's: small calls of every array function of every family in
cukern._registry, forward and backward, every dtype and option, and every custom op of
cukern.torch through its eager Function and its custom op (backward with an upstream gradient
of 3, then 1). Attention's cases run twice: in the default process (on Hopper, its sm_90a
kernels) and in one with CUKERN_ATTENTION_SM80=1 (its sm_80 kernels).

Steps: (1) a warm-up runs every case once without the sanitizer, in parallel processes: it
compiles every kernel into CuPy's cache (CUPY_CACHE_DIR, shared by every process here; the
sm_90a kernels, which CuPy does not build, into cukern's own, CUKERN_CACHE_DIR) and builds
cukern.torch's native extension, so that nothing is compiled under the sanitizer; a case that
fails there stops the run (unless --keep-going). (2) Each tool runs the cases in processes of
its own, all tools at once, with exact allocations (PYTORCH_NO_CUDA_MEMORY_CACHING=1, CuPy
without its pool): ``compute-sanitizer --tool <t> [flags] --error-exitcode 0 --print-limit 20
python tools/sanitize.py --run ...``. (3) The processes' logs are read for compute-sanitizer's
summaries ("ERROR SUMMARY: N errors"; racecheck's "RACECHECK SUMMARY: N hazards displayed (E
errors, W warnings)") and one line a tool printed, with the first reports and the case running
when each was printed. --out gets summary.txt, warmup.log and one log a tool (the processes'
logs one after another). The exit status is 0 when every tool reported 0 errors (and racecheck
0 hazards), every case ran and nothing timed out; 1 otherwise; 2 when no tool could run.

The whole run keeps to --budget seconds (default 560): tools still running then are stopped
(or after --timeout seconds), and their lines say how far they got.
"""
from __future__ import annotations

import argparse
import concurrent.futures
import importlib.util
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TESTS = ROOT / "tests"
TOOLS = ("memcheck", "initcheck", "racecheck", "synccheck")
MARK = "[sanitize]"

# Flags every tool gets, then the optional ones: each given only where `compute-sanitizer
# --help` lists it (and a trial run accepts it), as versions differ; as --name=value, which
# also holds for the options whose value has become optional ("--track-unused-memory").
BASE_FLAGS = ("--error-exitcode", "0", "--print-limit", "20")
COMMON_OPTIONS = (("--target-processes", "application-only"),   # (not the compilers a build may start)
                  ("--show-backtrace", "device"))
TOOL_OPTIONS = {
    # padding after each allocation: an access past the end cannot land in the next one
    "memcheck": (("--padding", "1024"), ("--check-bulk-copy", "yes"), ("--check-warpgroup-mma", "yes")),
    # (no options: on the H200 host's compute-sanitizer every initcheck process given
    # --track-unused-memory=no exited with 255 and no summary; unused memory is not reported
    # unless asked for)
    "initcheck": (),
    "racecheck": (("--racecheck-report", "analysis"), ("--racecheck-memcpy-async", "yes")),
    "synccheck": (("--check-warpgroup-mma", "yes"),),
}
OPTION_ERROR = re.compile(r"unrecogni[sz]ed|unknown option|is invalid|invalid (?:option|value|argument)|"
                          r"not a valid", re.I)

ERROR_SUMMARY = re.compile(r"^=+ ERROR SUMMARY: (\d+) errors?", re.M)
RACECHECK_SUMMARY = re.compile(r"^=+ RACECHECK SUMMARY: (\d+) hazards? displayed \((\d+) errors?, (\d+) warnings?\)",
                               re.M)
# A report's first line ("========= Invalid __global__ read of size 4 bytes"); its details are
# indented further ("=========     at norm_fwd<...>+0x1a0 in ...").
REPORT = re.compile(r"^=+ (?! )(?!ERROR SUMMARY|RACECHECK SUMMARY|LEAK SUMMARY|COMPUTE-SANITIZER|"
                    r"Target application)(.+)$")
WHERE = re.compile(r"^=+ {2,}at (.+?)(?:\+0x[0-9a-fA-F]+)?(?: in .*)?$")


# ---- the logs ------------------------------------------------------------------------------------

@dataclass
class Report:
    case: str
    text: str
    where: str = ""


@dataclass
class RunLog:
    """What one process's log says."""
    errors: int | None = None             # ERROR SUMMARY (None: not printed)
    hazards: tuple | None = None          # racecheck: (displayed, errors, warnings)
    total: int | None = None              # cases the process had
    started: int = 0                      # cases it began
    last: str = ""                        # the last case it began
    failed: list = field(default_factory=list)     # (case, message)
    done: bool = False                    # it got to the end
    compiled: int = 0                     # kernels it compiled (cache misses)
    device: str = ""                      # the GPU it ran on
    reports: list = field(default_factory=list)    # Report, in order


def parse_log(text: str) -> RunLog:
    """Read a log: this tool's markers and compute-sanitizer's reports and summaries."""
    log = RunLog()
    m = ERROR_SUMMARY.findall(text)
    if m:
        log.errors = int(m[-1])
    m = RACECHECK_SUMMARY.findall(text)
    if m:
        log.hazards = tuple(int(v) for v in m[-1])
        if log.errors is None:   # (racecheck of compute-sanitizer 2025.3 prints no ERROR SUMMARY)
            log.errors = log.hazards[1]
    case = "(before the first case)"
    pending = None
    for line in text.splitlines():
        if line.startswith(MARK):
            rest = line[len(MARK):].strip()
            if rest.startswith("case "):
                log.started += 1
                case = log.last = rest.split(" ", 2)[2] if rest.count(" ") >= 2 else rest
            elif rest.startswith("FAILED "):
                name, _, msg = rest[len("FAILED "):].partition(": ")
                log.failed.append((name, msg))
            elif rest.startswith("done "):
                log.done = True
                m = re.search(r"(\d+) kernels compiled", rest)
                log.compiled = int(m.group(1)) if m else 0
            elif rest.startswith("device "):
                log.device = rest[len("device "):]
            elif re.match(r"\d+ cases", rest):
                log.total = int(rest.split()[0])
            continue
        m = WHERE.match(line)
        if m and pending is not None and not pending.where:
            pending.where = m.group(1).strip()
            continue
        m = REPORT.match(line)
        # (a sanitizer's warnings are no reports, but for racecheck's hazards of the warning level)
        if m and (not m.group(1).startswith("Warning:") or "Race reported" in m.group(1)):
            pending = Report(case, m.group(1).strip())
            race = re.search(r"access at (.+?)\+0x[0-9a-fA-F]+", pending.text)
            if race:   # (racecheck names the first access's function in the report's line)
                pending.where = race.group(1)
            log.reports.append(pending)
    return log


def kernel_of(where: str) -> str:
    """The function's name in a report's location ("void norm_fwd<float, 4>(const float *)" ->
    "norm_fwd")."""
    m = re.match(r"(?:void\s+)?(?:[\w:]+::)?(\w+)\s*[<(]", where.strip())
    return m.group(1) if m else where.strip().split("(")[0].split("<")[0].split()[-1:][0] if where.strip() else ""


def cukern_kernels() -> set:
    """The names of every __global__ function cukern launches (its families' and shared modules')."""
    from cukern import _registry

    names = set()
    for _, instances in _registry.kernel_modules():
        try:
            names.update(i.kernel_name for i in instances())
        except Exception:  # noqa: BLE001 - (a module whose list fails: its reports are tagged "other")
            pass
    return names


def summary_line(tool: str, logs: list, seconds: float, notes: list) -> str:
    """``memcheck: 0 errors (N cases, X s)``, with racecheck's hazards and what went wrong."""
    errors = [lg.errors for lg in logs]
    err = "?" if any(e is None for e in errors) else str(sum(errors))
    line = f"{tool}: {err} error{'' if err == '1' else 's'}"
    if tool == "racecheck":
        hz = [lg.hazards for lg in logs]
        if any(h is None for h in hz):
            line += ", hazards ?"
        else:
            d, e, w = (sum(h[i] for h in hz) for i in range(3))
            line += f", {d} hazard{'' if d == 1 else 's'} displayed ({e} error{'' if e == 1 else 's'}, " \
                    f"{w} warning{'' if w == 1 else 's'})"
    started = sum(lg.started for lg in logs)
    total = [lg.total for lg in logs]
    cases = f"{started} cases" if any(t is None for t in total) or started == sum(total) \
        else f"{started} of {sum(total)} cases"
    line += f" ({cases}, {seconds:.0f} s)"
    return line + "".join(f"; {n}" for n in notes)


def clean(tool: str, logs: list) -> bool:
    """Whether a tool's processes all finished every case with nothing reported."""
    if not logs:
        return False
    for lg in logs:
        if lg.errors is None or lg.errors or lg.failed or not lg.done:
            return False
        if tool == "racecheck" and (lg.hazards is None or lg.hazards[0]):
            return False
    return True


# ---- compute-sanitizer ---------------------------------------------------------------------------

def find_sanitizer(given: str | None) -> str | None:
    candidates = [given, os.environ.get("COMPUTE_SANITIZER"), shutil.which("compute-sanitizer"),
                  "/usr/local/cuda/bin/compute-sanitizer"]
    candidates += sorted((str(p) for p in Path("/usr/local").glob("cuda-*/bin/compute-sanitizer")), reverse=True)
    for c in candidates:
        if c and Path(c).is_file() and os.access(c, os.X_OK):
            return c
    return None


# The trial run of each tool: a CUDA allocation, where compute-sanitizer may refuse the device.
PROBE = "import cupy; cupy.zeros(4); cupy.cuda.runtime.deviceSynchronize()"
UNSUPPORTED = re.compile(r"Device not supported|not supported on this (?:device|platform)", re.I)


def tool_flags(sanitizer: str, tool: str, help_text: str, env: dict, probe: str = PROBE) -> tuple:
    """(flags or None, note) for ``tool``: the base flags and the optional ones this
    compute-sanitizer lists and accepts, tried on ``probe`` (Python code); None where the tool
    does not run at all."""
    wanted = [o for o in COMMON_OPTIONS + TOOL_OPTIONS.get(tool, ()) if o[0] in help_text]
    for options in (wanted, []):
        flags = [*BASE_FLAGS, *(_flag(o) for o in options)]
        try:
            p = subprocess.run([sanitizer, "--tool", tool, *flags, sys.executable, "-c", probe], env=env,
                               capture_output=True, text=True, timeout=90)
            text, ran = p.stdout + p.stderr, True
        except (OSError, subprocess.SubprocessError) as e:
            text, ran = f"{type(e).__name__}: {e}", False
        if ran and UNSUPPORTED.search(text):
            return None, f"compute-sanitizer cannot check this device ({_first_line(text, UNSUPPORTED)})"
        if ran and not OPTION_ERROR.search(text):
            if options == wanted:
                return flags, None
            # (some optional flag was refused: those taken one at a time)
            taken = [o for o in wanted if _accepts(sanitizer, tool, o, env, probe)]
            refused = [o[0] for o in wanted if o not in taken]
            return [*BASE_FLAGS, *(_flag(o) for o in taken)], f"flags refused: {' '.join(refused)}"
        if not options:
            return None, f"compute-sanitizer --tool {tool} does not run: {_first_line(text)}"
    return None, "unreachable"


def _flag(option: tuple) -> str:
    return f"{option[0]}={option[1]}"


def _accepts(sanitizer: str, tool: str, option: tuple, env: dict, probe: str) -> bool:
    try:
        p = subprocess.run([sanitizer, "--tool", tool, *BASE_FLAGS, _flag(option), sys.executable, "-c", probe],
                           env=env, capture_output=True, text=True, timeout=90)
    except (OSError, subprocess.SubprocessError):
        return False
    return not OPTION_ERROR.search(p.stdout + p.stderr)


def _first_line(text: str, pattern=OPTION_ERROR) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    hits = [ln for ln in lines if pattern.search(ln)]
    return (hits or lines or ["no output"])[0][:200]


def compute_capability() -> str | None:
    """The first GPU's compute capability from nvidia-smi ("9.0"), or None."""
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=compute_cap", "--format=csv,noheader"], capture_output=True,
                           text=True, timeout=30)
        return p.stdout.split()[0] if p.returncode == 0 and p.stdout.split() else None
    except (OSError, subprocess.SubprocessError):
        return None


# ---- processes ------------------------------------------------------------------------------------

@dataclass
class Proc:
    label: str
    log: Path
    cmd: list
    env: dict
    tool: str = ""
    popen: subprocess.Popen | None = None
    begun: float = 0.0
    ended: float | None = None
    timed_out: bool = False

    def start(self) -> None:
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "w") as f:
            f.write(f"# {' '.join(self.cmd)}\n")
            f.flush()
            self.popen = subprocess.Popen(self.cmd, stdout=f, stderr=subprocess.STDOUT, env=self.env, cwd=ROOT,
                                          start_new_session=True)
        self.begun = time.monotonic()

    def signal(self, sig) -> None:
        """``sig`` to the process's group (compute-sanitizer and the program under it)."""
        try:
            os.killpg(self.popen.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    @property
    def seconds(self) -> float:
        return (self.ended or time.monotonic()) - self.begun

    def text(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""


def run_all(procs: list, deadline: float, progress=None, every: float = 30.0) -> None:
    """Start ``procs``, wait for them until ``deadline`` (monotonic), stopping those still
    running then; ``progress()`` is called every ``every`` seconds."""
    for p in procs:
        p.start()
    last = time.monotonic()
    while True:
        now = time.monotonic()
        running = [p for p in procs if p.ended is None]
        for p in running:
            if p.popen.poll() is not None:
                p.ended = now
        running = [p for p in procs if p.ended is None]
        if not running:
            return
        if now >= deadline:   # (all stopped at once: SIGTERM, then SIGKILL to what is left after 5 s)
            for p in running:
                p.timed_out = True
                p.signal(signal.SIGTERM)
            for sig in (signal.SIGKILL, None):
                end = time.monotonic() + 5
                while time.monotonic() < end and any(p.popen.poll() is None for p in running):
                    time.sleep(0.2)
                for p in running:
                    if sig is not None and p.popen.poll() is None:
                        p.signal(sig)
            for p in running:
                p.ended = time.monotonic()
            return
        if progress is not None and now - last >= every:
            progress()
            last = now
        time.sleep(0.1)   # (a phase ends within a tenth of a second of its last process)


def merge_logs(procs: list, path: Path, limit: int = 12 << 20) -> None:
    """The processes' logs one after another in one file, each under a header (each kept to
    its share of ``limit`` bytes: its head and its tail)."""
    share = max(1 << 16, limit // max(1, len(procs)))
    parts = []
    for p in procs:
        text = p.text()
        if len(text) > share:
            text = text[:share // 2] + f"\n[... {len(text) - share} characters left out ...]\n" + text[-share // 2:]
        state = "timed out" if p.timed_out else "running" if p.ended is None else \
            f"exit code {p.popen.returncode if p.popen else '-'}"
        parts.append(f"#### {p.label} ({state}, {p.seconds:.0f} s)\n{text}\n")
    try:
        path.write_text("".join(parts))
    except OSError:
        pass


def child_cmd(families, variant: str | None, shard: tuple, dry: bool) -> list:
    cmd = [sys.executable, str(Path(__file__).resolve()), "--run", "--shard", f"{shard[0]}/{shard[1]}"]
    for f in families:
        cmd += ["--family", f]
    if variant:
        cmd += ["--variant", variant]
    if dry:
        cmd.append("--dry")
    return cmd


def base_env(cache_dir: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), str(TESTS)] + ([env["PYTHONPATH"]] if env.get("PYTHONPATH")
                                                                    else []))
    env["CUPY_CACHE_DIR"] = str(cache_dir)
    env["PYTHONUNBUFFERED"] = "1"
    env.setdefault("CUKERN_NATIVE", "wait")   # (the cases run the native path from their first call)
    return env


def _auto(n: int, lo: int, hi: int) -> int:
    return max(lo, min(hi, n))


# ---- the driver -----------------------------------------------------------------------------------

def _say(*lines) -> None:
    for line in lines:
        print(line, flush=True)


def _families(given) -> list:
    sys.path[:0] = [str(ROOT), str(TESTS)]
    import sanitize_cases as sc

    known = sc.families()
    names = [n for g in (given or []) for n in g.split(",") if n] or list(known)
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(f"unknown famil{'ies' if len(unknown) > 1 else 'y'} {', '.join(unknown)} "
                         f"(known: {', '.join(known)})")
    return [n for n in known if n in names]


def list_cases(families) -> int:
    import sanitize_cases as sc

    total, again = 0, 0
    for name in families:
        cs = sc.cases(name)
        variants = [f"{' '.join(f'{k}={v}' for k, v in env.items())}" for env, fams in sc.VARIANTS.values()
                    if name in fams]
        print(f"{name}: {len(cs)} cases" + (f" (run again with {'; '.join(variants)})" if variants else ""))
        for c in cs:
            print(f"  {c.name}")
        total += len(cs)
        again += len(cs) * len(variants)
    print(f"total: {total} cases" + (f", {again} run again in another process" if again else ""))
    return 0


def variants_to_run(families, dry: bool) -> list:
    """None (the default process), then the variants that apply: sm80 on a Hopper GPU alone
    (elsewhere attention's default path is the sm_80 one)."""
    import sanitize_cases as sc

    out = [None]
    for name, (_, fams) in sc.VARIANTS.items():
        if not set(fams) & set(families):
            continue
        if name == "sm80" and not dry:
            cc = compute_capability()
            if cc is not None and cc != "9.0":
                continue
        out.append(name)
    return out


def warm_up(args, families, variants, env, work: Path, out: Path, deadline: float) -> tuple:
    """Every case once, no sanitizer, in parallel processes (the kernels compiled into the
    caches; the native extension built once). (ok, native_ok, lines to print); the logs go to
    ``out``/warmup.log."""
    jobs = args.jobs or _auto(os.cpu_count() or 4, 2, 16)
    extra = [v for v in variants if v]
    per_variant = {v: max(1, jobs // 4) for v in extra}
    per_variant[None] = max(1, jobs - sum(per_variant.values()))
    procs = []
    for v in variants:
        venv = dict(env, CUKERN_NATIVE="0", **(_variant_env(v)))
        n = per_variant[v]
        procs += [Proc(f"warm-up {v or 'default'} {i}/{n}", work / f"warmup-{v or 'default'}-{i}.log",
                       child_cmd(families, v, (i, n), args.dry), venv) for i in range(n)]
    import sanitize_cases as sc

    for tool, tenv in sc.TOOL_ENV.items():   # (what a tool's own environment compiles besides)
        fams = [f for f in families if f in sc.TOOL_ENV_FAMILIES.get(tool, families)]
        if tool in args.tool_list and fams:
            procs.append(Proc(f"warm-up {tool}", work / f"warmup-{tool}.log", child_cmd(fams, None, (0, 1), args.dry),
                              dict(env, CUKERN_NATIVE="0", **tenv)))
    native = None
    if not args.dry and env.get("CUKERN_NATIVE", "1") != "0" and importlib.util.find_spec("torch") is not None:
        code = ("import sys\nfrom cukern.torch import _native\n"
                "sys.exit(0 if _native.wait() is not None else 3)")
        native = Proc("native extension", work / "warmup-native.log", [sys.executable, "-c", code], env)
        procs.append(native)
    t0 = time.monotonic()
    run_all(procs, deadline)
    merge_logs(procs, out / "warmup.log")
    lines, ok = [], True
    logs = [(p, parse_log(p.text())) for p in procs if p is not native]
    n = sum(lg.started for _, lg in logs)
    fails = [(name, msg) for _, lg in logs for name, msg in lg.failed]
    device = next((lg.device for _, lg in logs if lg.device), None)
    lines.append(f"warm-up: {n} cases in {time.monotonic() - t0:.0f} s, {len(procs) - (native is not None)} "
                 f"processes, {len(fails)} failed" + (f" ({device})" if device else ""))
    for p, lg in logs:
        if p.timed_out or not lg.done:
            ok = False
            why = "timed out" if p.timed_out else f"exit code {p.popen.returncode}"
            lines.append(f"  {p.label}: did not finish ({why}; last case {lg.last or '-'})")
    for name, msg in fails[:20]:
        lines.append(f"  FAILED {name}: {msg[:300]}")
    if len(fails) > 20:
        lines.append(f"  ... and {len(fails) - 20} more")
    if not ok or fails:
        lines.append(f"  (logs: {out / 'warmup.log'})")
    ok = ok and not fails
    native_ok = native is not None and not native.timed_out and native.popen.returncode == 0
    if native is not None and not native_ok:
        lines.append("  cukern.torch's native extension did not build (warmup.log): the torch cases run the "
                     "Python path (CUKERN_NATIVE=0)")
    return ok, native_ok, lines


def _tool_env(tool: str) -> dict:
    import sanitize_cases as sc

    return dict(sc.TOOL_ENV.get(tool, {}))


def _variant_env(variant: str | None) -> dict:
    import sanitize_cases as sc

    return dict(sc.VARIANTS[variant][0]) if variant else {}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tools", default=",".join(TOOLS), help="comma-separated subset of " + ", ".join(TOOLS))
    ap.add_argument("--family", action="append", help="only these families (repeatable, or comma-separated)")
    ap.add_argument("--out", help="log directory (default: $OUT if set, else ./sanitize-out)")
    ap.add_argument("--timeout", type=float, help="seconds a tool may run (default: what is left of --budget)")
    ap.add_argument("--budget", type=float, default=560.0, help="seconds for the whole run (default 560)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit (no GPU needed)")
    ap.add_argument("--keep-going", action="store_true", help="run the tools even when cases failed in the warm-up")
    ap.add_argument("--no-warmup", action="store_true", help="skip the warm-up (the caches are filled already)")
    ap.add_argument("--jobs", type=int, help="warm-up processes (default: the CPU count, 2 to 16)")
    ap.add_argument("--shards", type=int, help="processes a tool splits its cases over, in each kind of process "
                                                     "(default: by CPUs)")
    ap.add_argument("--cache-dir", help="CUPY_CACHE_DIR for every process (default: $CUPY_CACHE_DIR, else CuPy's "
                                        "~/.cupy/kernel_cache)")
    ap.add_argument("--sanitizer", help="the compute-sanitizer executable (default: $COMPUTE_SANITIZER, PATH, "
                                        "/usr/local/cuda/bin)")
    # (a process of the run: the cases themselves)
    ap.add_argument("--run", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    ap.add_argument("--shard", default="0/1", help=argparse.SUPPRESS)
    # (the CPU dry run: NumPy arrays and fake kernels, for this tool's own tests)
    ap.add_argument("--dry", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    families = _families(args.family)
    if args.run:
        return run_cases(families, args)
    if args.list:
        return list_cases(families)

    start = time.monotonic()
    deadline = start + args.budget
    tools = [t.strip() for t in args.tools.split(",") if t.strip()]
    args.tool_list = tools
    bad = [t for t in tools if t not in TOOLS]
    if bad or not tools:
        _say(f"--tools: unknown {', '.join(bad) or '(none given)'}; choose from {', '.join(TOOLS)}")
        return 2
    out = Path(args.out or os.environ.get("OUT") or "sanitize-out").resolve()
    out.mkdir(parents=True, exist_ok=True)
    sanitizer = find_sanitizer(args.sanitizer)
    if sanitizer is None:
        _say("compute-sanitizer not found (PATH, $COMPUTE_SANITIZER, /usr/local/cuda/bin); give it with --sanitizer")
        return 2
    cache = Path(args.cache_dir or os.environ.get("CUPY_CACHE_DIR") or Path.home() / ".cupy" / "kernel_cache")
    cache.mkdir(parents=True, exist_ok=True)
    env = base_env(cache)
    variants = variants_to_run(families, args.dry)
    # (each process's own log here; merged into one file a tool under `out`)
    work = Path(tempfile.mkdtemp(prefix="cukern-sanitize-"))
    try:
        version = subprocess.run([sanitizer, "--version"], capture_output=True, text=True, timeout=60).stdout
        p = subprocess.run([sanitizer, "--help"], capture_output=True, text=True, timeout=60)
        help_text = p.stdout + p.stderr
    except (OSError, subprocess.SubprocessError) as e:
        version = help_text = ""
        _say(f"compute-sanitizer --help failed ({e}); the optional flags are left out")
    version = next((ln.strip() for ln in version.splitlines() if "ersion" in ln), "")
    head = [f"compute-sanitizer: {sanitizer}" + (f" ({version})" if version else ""),
            f"families: {', '.join(families)}; processes: {', '.join(v or 'default' for v in variants)}; "
            f"kernel cache: {cache}; logs: {out}"]
    _say(*head)
    try:
        return _run_tools(args, families, variants, tools, sanitizer, help_text, env, work, out, start, deadline,
                          head)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _run_tools(args, families, variants, tools, sanitizer, help_text, env, work, out, start, deadline, head) -> int:
    probe = "pass" if args.dry else PROBE
    with concurrent.futures.ThreadPoolExecutor(len(tools)) as pool:
        flag_jobs = {t: pool.submit(tool_flags, sanitizer, t, help_text, env, probe) for t in tools}
        native_ok = True
        if not args.no_warmup:
            ok, native_ok, lines = warm_up(args, families, variants, env, work, out,
                                           min(deadline - 60, start + 300))
            head += lines
            _say(*lines)
            if not ok and not args.keep_going:
                head.append("the warm-up failed: no tool was run (--keep-going runs them anyway)")
                _say(head[-1])
                (out / "summary.txt").write_text("\n".join(head) + "\n")
                return 1
        flags = {t: j.result() for t, j in flag_jobs.items()}
    if not native_ok:
        env["CUKERN_NATIVE"] = "0"

    sanitized = dict(env, PYTORCH_NO_CUDA_MEMORY_CACHING="1")
    shards = args.shards or _auto((os.cpu_count() or 4) // (2 * len(tools)), 1, 4)
    procs, notes = [], {t: [] for t in tools}
    for tool in tools:
        tflags, note = flags[tool]
        if note:
            notes[tool].append(note)
        if tflags is None:
            continue
        for v in variants:
            for i in range(shards):
                label = tool + (f"-{v}" if v else "") + (f"-{i}" if shards > 1 else "")
                cmd = [sanitizer, "--tool", tool, *tflags, *child_cmd(families, v, (i, shards), args.dry)]
                procs.append(Proc(label, work / f"{label}.log", cmd,
                                  dict(sanitized, **_variant_env(v), **_tool_env(tool)), tool))
    if not procs:
        head += [f"{t}: {'; '.join(notes[t])}" for t in tools]
        _say(*head[-len(tools):])
        (out / "summary.txt").write_text("\n".join(head) + "\n")
        return 2
    limit = deadline - 20 - time.monotonic()
    if args.timeout:
        limit = min(limit, args.timeout)
    _say(f"running {len(procs)} sanitized processes ({', '.join(p.label for p in procs)}), "
         f"at most {max(limit, 0):.0f} s")

    def merge():
        for tool in tools:
            mine = [p for p in procs if p.tool == tool]
            if mine:
                merge_logs(mine, out / f"{tool}.log")

    def progress():
        merge()
        by_tool = {}
        for p in procs:
            lg = parse_log(p.text())
            s, t = by_tool.get(p.tool, (0, 0))
            by_tool[p.tool] = (s + lg.started, t + (lg.total or 0))
        _say(f"  {time.monotonic() - start:.0f} s: " + ", ".join(f"{t} {s}/{n}" for t, (s, n) in by_tool.items()))

    run_all(procs, time.monotonic() + max(limit, 1), progress)
    merge()

    lines, detail, status = [], [], 0
    for tool in tools:
        mine = [p for p in procs if p.tool == tool]
        logs = [parse_log(p.text()) for p in mine]
        tnotes = list(notes[tool])
        for p, lg in zip(mine, logs):
            if p.timed_out:
                tnotes.append(f"{p.label} stopped after {p.seconds:.0f} s at case {lg.started}/{lg.total or '?'} "
                              f"({lg.last or '-'})")
            elif lg.errors is None:
                tnotes.append(f"{p.label}: no ERROR SUMMARY (exit code {p.popen.returncode})")
            elif not lg.done:
                tnotes.append(f"{p.label}: the cases did not finish (exit code {p.popen.returncode}; last case "
                              f"{lg.last or '-'})")
        nfail = sum(len(lg.failed) for lg in logs)
        if nfail:
            tnotes.append(f"{nfail} case{'s' if nfail > 1 else ''} failed")
        ncomp = sum(lg.compiled for lg in logs)
        if ncomp:
            tnotes.append(f"{ncomp} kernels compiled under the sanitizer (the warm-up missed them)")
        seconds = max((p.seconds for p in mine), default=0.0)
        lines.append(summary_line(tool, logs, seconds, tnotes))
        if not clean(tool, logs) or any(p.timed_out for p in mine):
            status = 1
        reports = [r for lg in logs for r in lg.reports]
        if reports:
            ours = cukern_kernels()
            mine_n = sum(kernel_of(r.where) in ours for r in reports)
            detail.append(f"{tool}: {len(reports)} report{'s' if len(reports) > 1 else ''} printed ({mine_n} in "
                          f"cukern's kernels; {tool}.log), the first with the case running when each was printed:")
            detail += [f"  [{r.case}] {r.text[:200]}" + (f"\n      at {r.where[:200]}" if r.where else "")
                       + ("" if not r.where or kernel_of(r.where) in ours else "  (not a cukern kernel)")
                       for r in reports[:8]]
        for lg in logs:
            for name, msg in lg.failed[:5]:
                detail.append(f"  {tool}: FAILED {name}: {msg[:300]}")
    (out / "summary.txt").write_text("\n".join(head + [""] + detail + [""] + lines) + "\n")
    _say("", *detail, "", *lines)
    return status


# ---- a process of the run: the cases ------------------------------------------------------------

_COMPILED = [0]


def _count_arch_compiles() -> None:
    """Count the kernels NVRTC builds for sm_90a in this process (cukern's cubin cache's misses)."""
    from cukern import _nvrtc

    original = _nvrtc.compile_program

    def counted(*a, **k):
        _COMPILED[0] += 1
        return original(*a, **k)

    _nvrtc.compile_program = counted


def _count_cupy_compiles() -> None:
    """Count the kernels CuPy compiles (its cache's misses) in this process."""
    from cupy.cuda import compiler

    fn = getattr(compiler, "_compile_using_nvrtc_no_warning", None)
    if fn is None:
        return

    def counted(*a, **k):
        _COMPILED[0] += 1
        return fn(*a, **k)

    compiler._compile_using_nvrtc_no_warning = counted


def run_cases(families, args) -> int:
    """Run this process's share of the cases, each followed by a device synchronization and a
    check of the fault record; a case that raises is reported (a FAILED line) and the next one
    runs."""
    import sanitize_cases as sc

    index, count = (int(v) for v in args.shard.split("/"))
    cases = sc.selected(families, args.variant)[index::count]
    sc.configure_for_tool()
    if args.dry:
        cases = [c for c in cases if c.host]
    print(f"{MARK} {len(cases)} cases ({args.variant or 'default'} process, shard {index}/{count})", flush=True)
    context = sc.dry_run() if args.dry else None
    sync = check = None
    if context is None:
        import cupy

        import cukern

        cupy.cuda.set_allocator(None)   # (exact allocations: an access past a buffer's end is outside any)
        cupy.cuda.set_pinned_memory_allocator(None)
        _count_arch_compiles()
        _count_cupy_compiles()
        p = cupy.cuda.runtime.getDeviceProperties(0)
        name = p["name"].decode() if isinstance(p["name"], bytes) else p["name"]
        print(f"{MARK} device {name}, sm_{p['major']}{p['minor']}", flush=True)
        sync, check = cupy.cuda.runtime.deviceSynchronize, cukern.check_errors
    else:
        context.__enter__()
    t0 = time.monotonic()
    times, bad = [], 0
    try:
        for k, case in enumerate(cases):
            print(f"{MARK} case {k + 1}/{len(cases)} {case.name}", flush=True)
            t = time.monotonic()
            try:
                case.run()
                if sync is not None:
                    sync()
                    check()   # (a fault a case did not expect: a bad input, or a kernel that misreads)
            except Exception as e:  # noqa: BLE001 - reported, and the next case runs
                bad += 1
                msg = " ".join(str(e).split())[:500]
                print(f"{MARK} FAILED {case.name}: {type(e).__name__}: {msg}", flush=True)
                print("".join(traceback.format_exception(type(e), e, e.__traceback__)[-6:]), flush=True)
                if sync is not None:
                    try:
                        sync()
                        check()
                    except Exception:  # noqa: BLE001 - (a sticky error: the later cases will say)
                        pass
            times.append((time.monotonic() - t, case.name))
    finally:
        if context is not None:
            context.__exit__(None, None, None)
    slow = ", ".join(f"{n} {s:.1f} s" for s, n in sorted(times, reverse=True)[:5])
    print(f"{MARK} slowest: {slow}", flush=True)
    print(f"{MARK} done {len(cases)} cases, {bad} failed, {_COMPILED[0]} kernels compiled, "
          f"{time.monotonic() - t0:.1f} s", flush=True)
    return 0   # (failed cases are told by the lines above; compute-sanitizer is left to report its own)


if __name__ == "__main__":
    sys.exit(main())
