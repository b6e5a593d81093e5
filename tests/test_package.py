"""The package itself, with no GPU: import, public API, the wheel's contents, source lookup."""
from __future__ import annotations

import email
import importlib.util
import inspect
import os
import re
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

import cukern
from cukern import _kernels

REPO = Path(__file__).resolve().parents[1]

# The public API that exists now; families added later extend cukern.__all__.
PUBLIC = ("layer_norm", "layer_norm_backward", "rms_norm", "rms_norm_backward", "CompileError")


def _python(code: str, cwd: Path, **env) -> str:
    """Run ``code`` in a fresh interpreter (cwd first on sys.path) and return its stdout."""
    full_env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", **env}
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=full_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_import_is_lazy():
    """`import cukern` needs no GPU and imports neither CuPy nor torch (they load on first use)."""
    out = _python("import sys, cukern\n"
                  "print(cukern.__file__)\n"
                  "print(sorted(m for m in ('cupy', 'torch') if m in sys.modules))", REPO)
    file, eager = out.splitlines()
    assert Path(file).resolve() == REPO / "cukern" / "__init__.py"
    assert eager == "[]", f"`import cukern` imported {eager} eagerly"


def test_public_api():
    assert re.fullmatch(r"\d+\.\d+\.\d+", cukern.__version__), cukern.__version__
    assert cukern.__doc__ and cukern.__doc__.strip()
    missing = [n for n in PUBLIC if n not in cukern.__all__]
    assert not missing, f"not in cukern.__all__: {missing}"
    for name in cukern.__all__:
        obj = getattr(cukern, name, None)
        assert obj is not None, f"cukern.__all__ lists {name}, which cukern does not define"
        assert inspect.getdoc(obj) and inspect.getdoc(obj).strip(), f"cukern.{name} has no docstring"
    assert issubclass(cukern.CompileError, RuntimeError)


def test_source_dir_in_checkout():
    """Imported from the checkout, the sources are found at <checkout>/cuda_src."""
    out = _python("from cukern import _kernels; print(_kernels.source_dir())", REPO)
    assert Path(out.strip()).resolve() == REPO / "cuda_src"
    here = _kernels.source_dir()
    assert (here / "norm.cu").is_file() and (here / "common" / "dtype.cuh").is_file()


@pytest.fixture(scope="module")
def dists(tmp_path_factory):
    """sdist and wheel built from the checkout (the wheel from the sdist, as pip would)."""
    missing = [m for m in ("build", "hatchling") if importlib.util.find_spec(m) is None]
    if missing:  # both are in the `test` extra; CI must not skip this
        message = f"{' and '.join(missing)} not installed (pip install -e '.[dev]')"
        if os.environ.get("CI"):
            pytest.fail(f"CI is set but {message}")
        pytest.skip(message)
    out = tmp_path_factory.mktemp("dist")
    done = subprocess.run([sys.executable, "-m", "build", "--no-isolation", "--outdir", str(out), str(REPO)],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"python -m build failed:\n{done.stdout}\n{done.stderr}"
    (sdist,) = out.glob("cukern-*.tar.gz")
    (wheel,) = out.glob("cukern-*.whl")
    return sdist, wheel


@pytest.mark.packaging
def test_wheel_contents(dists):
    """The wheel carries the CUDA sources as cukern/cuda_src/, and no byte code."""
    _, wheel = dists
    names = set(zipfile.ZipFile(wheel).namelist())
    for need in ("cukern/__init__.py", "cukern/_kernels.py", "cukern/cuda_src/norm.cu",
                 "cukern/cuda_src/common/dtype.cuh", "cukern/demo/model.py"):
        assert need in names, f"{need} missing from {wheel.name}: {sorted(names)}"
    sources = {p.relative_to(REPO).as_posix() for p in (REPO / "cuda_src").rglob("*")
               if p.is_file() and p.suffix in (".cu", ".cuh")}
    shipped = {n.removeprefix("cukern/") for n in names if n.startswith("cukern/cuda_src/")}
    assert sources <= shipped, f"not in the wheel: {sorted(sources - shipped)}"
    assert not [n for n in names if n.endswith(".pyc") or "__pycache__" in n]
    assert not [n for n in names if n.startswith(("tests/", "asv_bench/", "cuda_src/"))]
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names), "the LICENSE file is not in the wheel"


@pytest.mark.packaging
def test_wheel_metadata(dists):
    _, wheel = dists
    with zipfile.ZipFile(wheel) as z:
        (meta_name,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        meta = email.message_from_bytes(z.read(meta_name))
    assert meta["Name"] == "cukern"
    assert meta["Version"] == cukern.__version__
    assert meta["Requires-Python"] == ">=3.10"
    assert set(meta.get_all("Provides-Extra")) == {"cuda12", "cuda13", "torch-cuda12", "torch-cuda13", "torch",
                                                   "bench", "hf", "dev"}
    assert meta["License-Expression"] == "BSD-3-Clause"
    assert meta["Description-Content-Type"] == "text/markdown" and "# cukern" in meta.get_payload()
    assert meta.get_all("Project-URL") and any("Python :: 3.12" in c for c in meta.get_all("Classifier"))
    requires = [r.replace("'", '"') for r in meta.get_all("Requires-Dist")]
    base = [r for r in requires if "extra ==" not in r]
    assert [r.split(">")[0].split(";")[0].strip() for r in base] == ["numpy"], base
    # CUDA flavours come with their toolkit libraries (NVRTC, headers); dev pins none.
    assert any(r.startswith("cupy-cuda13x[ctk]") and 'extra == "cuda13"' in r for r in requires)
    assert any(r.startswith("cupy-cuda12x[ctk]") and 'extra == "cuda12"' in r for r in requires)
    assert not [r for r in requires if 'extra == "dev"' in r and ("cupy" in r or "nvidia" in r or "torch" in r)]
    # A torch flavour takes CuPy without [ctk] (torch's CUDA libraries serve it; a second toolkit
    # requirement makes pip backtrack torch to a build for the other CUDA major) and a torch
    # range of that major alone; ninja builds cukern.torch's extension.
    for major, torch_range in (("13", "torch>=2.11"), ("12", "torch<2.11,>=2.4")):
        mine = sorted(r.split(";")[0].strip() for r in requires if f'extra == "torch-cuda{major}"' in r)
        assert mine == sorted([f"cupy-cuda{major}x>=14", "ml-dtypes", torch_range, "ninja"]), mine
    assert any(r.startswith("ninja") and 'extra == "torch"' in r for r in requires)


@pytest.mark.packaging
def test_sdist_contents(dists):
    sdist, _ = dists
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    for need in ("pyproject.toml", "LICENSE", "README.md", "cukern/__init__.py", "cuda_src/norm.cu",
                 "cuda_src/common/dtype.cuh"):
        assert need in names, f"{need} missing from {sdist.name}"


@pytest.mark.packaging
def test_installed_wheel_finds_its_sources(dists, tmp_path):
    """Unpacked wheel, imported away from the checkout: the sources come from cukern/cuda_src."""
    _, wheel = dists
    site = tmp_path.resolve() / "site"
    zipfile.ZipFile(wheel).extractall(site)
    out = _python("import cukern; from cukern import _kernels\n"
                  "print(cukern.__file__); print(_kernels.source_dir())\n"
                  "assert '#include \"' not in _kernels.load_source('norm.cu')", site,
                  PYTHONPATH=str(site))
    file, src = out.splitlines()
    assert Path(file).resolve() == site / "cukern" / "__init__.py"
    assert Path(src).resolve() == site / "cukern" / "cuda_src"


# ---- what the README tells a new user ------------------------------------------------------------

def _pyproject() -> dict:
    import tomllib

    return tomllib.loads((REPO / "pyproject.toml").read_text())


def _readme_installs() -> list[str]:
    """The extras of every ``pip install ... ".[a,b]"`` line in the README's code blocks."""
    text = (REPO / "README.md").read_text()
    blocks = re.findall(r"```(?:bash|sh)?\n(.*?)```", text, flags=re.S)
    extras = []
    for block in blocks:
        for line in block.splitlines():
            if re.match(r"\s*(python -m )?pip install", line):
                extras += re.findall(r'"(?:-e )?\.\[([^\]]+)\]"', line)
    return extras


def test_readme_install_lines_name_extras_that_exist():
    """Every extra the README's install lines name is defined in pyproject.toml, and the
    README names the ones a user picks between (the two CUDA flavours, torch, dev)."""
    defined = set(_pyproject()["project"]["optional-dependencies"])
    named = [e.strip() for group in _readme_installs() for e in group.split(",")]
    assert named, "the README has no pip install line with extras"
    assert set(named) <= defined, f"the README names undefined extras: {sorted(set(named) - defined)}"
    assert {"cuda12", "cuda13", "torch-cuda12", "torch-cuda13", "dev"} <= set(named)
    # (a CUDA flavour beside a PyPI torch is the pairing that backtracks torch: never in one line)
    for group in _readme_installs():
        names = {e.strip() for e in group.split(",")}
        assert not (names & {"cuda12", "cuda13"} and names & {"torch", "torch-cuda12", "torch-cuda13"}), group


def test_readme_test_command_and_marker_agree_with_pyproject():
    text = (REPO / "README.md").read_text()
    assert "python -m pytest -q" in text and "python -m cukern bench" in text
    markers = " ".join(_pyproject()["tool"]["pytest"]["ini_options"]["markers"])
    assert '-m "not compile"' in text and "compile:" in markers


def test_nothing_refers_to_files_outside_the_project():
    """A user's clone has only the repository: no file may point at the developers' notes."""
    # (the names are assembled, so that this file does not name them itself)
    notes = "|".join(["DES" + "IGN", "PERFOR" + "MANCE", "MET" + "HOD", "HOP" + "PER"])
    outside = re.compile(rf"({notes})\.md|\.\./shared/|shared/gpu" + "-host")
    listed = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if listed.returncode == 0 and listed.stdout.strip():   # the project's files (a clone's)
        paths = [REPO / p for p in listed.stdout.splitlines()]
    else:   # an sdist: every file but hidden folders
        paths = [p for p in REPO.rglob("*") if not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    offenders = []
    for path in paths:
        if (path.is_file() and path.suffix in (".py", ".md", ".sh", ".toml", ".cu", ".cuh", ".cfg", ".json")
                and "results" not in path.parts):
            if outside.search(path.read_text(errors="replace")):
                offenders.append(str(path.relative_to(REPO)))
    assert not offenders, f"these files refer to files outside the repository: {offenders}"
