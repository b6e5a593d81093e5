"""Write asv_bench/results/<machine>/machine.json with what the host is: the GPU, the CPU, the
OS, the RAM and the CPU count (asv's own ``asv machine`` records only the name when the
machine is named on the command line). Run it on the GPU machine after ``asv run``.

    python tools/asv_machine.py [--machine gpu-h200]     # default: gpu-<h100|h200|...> from the GPU's name
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def gpu_name() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=30).stdout.strip().splitlines()
    except (OSError, subprocess.SubprocessError):
        out = []
    if not out:
        return "unknown"
    name, mem, driver = (s.strip() for s in out[0].split(","))
    return f"{len(out)} x {name} ({mem}, driver {driver})"


def cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def ram() -> str:
    try:
        kb = int(re.search(r"MemTotal:\s+(\d+)", Path("/proc/meminfo").read_text()).group(1))
        return f"{kb // 1024 // 1024} GiB"
    except (OSError, AttributeError):
        return "unknown"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--machine", help="the asv machine name (default: gpu-<model> from the GPU's name)")
    a = p.parse_args()
    gpu = gpu_name()
    machine = a.machine or "gpu-" + (re.search(r"(h100|h200|a100|b200|l40s?)", gpu.lower()) or ["unknown"])[0]
    info = {"machine": machine, "gpu": gpu, "cpu": cpu_name(), "num_cpu": str(os.cpu_count()), "ram": ram(),
            "os": f"{platform.system()} {platform.release()}", "arch": platform.machine(), "version": 1}
    path = ROOT / "asv_bench" / "results" / machine / "machine.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(info, indent=4) + "\n")
    print(f"{path}: {info}")


if __name__ == "__main__":
    main()
