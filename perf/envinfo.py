"""What a results header records: GPU, clocks, driver, library versions, package commit."""

from __future__ import annotations

import datetime as _dt
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

import torch

from .baselines import dist_version

REPO_ROOT = Path(__file__).resolve().parent.parent


def _family():
    """The kernel family `Options` force (None: the device's own)."""
    try:
        import ffpa_cute

        return ffpa_cute.options.current().family
    except Exception:  # noqa: BLE001  (an unreadable FFPA_CUTE_ARCH: report it as set)
        return os.environ.get("FFPA_CUTE_ARCH")


def _run(cmd: list[str], timeout: float = 10.0) -> str | None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    return r.stdout.strip() if r.returncode == 0 else None


def nvidia_smi(fields: tuple[str, ...], index: int = 0) -> dict[str, str] | None:
    """One GPU's `nvidia-smi --query-gpu` fields, or None without nvidia-smi."""
    out = _run(["nvidia-smi", f"--id={index}", "--query-gpu=" + ",".join(fields),
                "--format=csv,noheader,nounits"])
    if not out:
        return None
    vals = [x.strip() for x in out.splitlines()[0].split(",")]
    return dict(zip(fields, vals)) if len(vals) == len(fields) else None


def sm_clocks(index: int = 0) -> dict:
    """Current and max SM clock in MHz (sample right after a load for the boost clock)."""
    q = nvidia_smi(("clocks.sm", "clocks.max.sm", "clocks.mem"), index) or {}

    def num(x):
        try:
            return int(float(x))
        except (TypeError, ValueError):
            return None

    return {"sm_clock_mhz": num(q.get("clocks.sm")), "sm_clock_max_mhz": num(q.get("clocks.max.sm")),
            "mem_clock_mhz": num(q.get("clocks.mem"))}


def git_commit(root: Path = REPO_ROOT) -> str | None:
    """Short commit of the repo, '+dirty' if ffpa_cute/ has uncommitted changes; env override."""
    env = os.environ.get("PERF_COMMIT")
    if env:
        return env
    sha = _run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"])
    if not sha:
        return None
    dirty = _run(["git", "-C", str(root), "status", "--porcelain", "--", "ffpa_cute"])
    return sha + ("+dirty" if dirty else "")


def collect_env(device: torch.device, impl_versions: dict | None = None,
                commit: str | None = None) -> dict:
    """Environment of this run; GPU fields are None on a machine without one."""
    env = {
        "date": _dt.datetime.now().isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "cutlass_dsl": dist_version("nvidia-cutlass-dsl"),
        "triton": dist_version("triton"),
        "commit": commit or git_commit(),
        "ffpa_cute_arch": _family(),
        "device": str(device),
        "gpu": None, "cc": None, "sm_count": None, "gpu_mem_gib": None, "driver": None,
        "sm_clock_mhz": None, "sm_clock_max_mhz": None, "mem_clock_mhz": None,
    }
    if device.type == "cuda" and torch.cuda.is_available():
        p = torch.cuda.get_device_properties(device)
        idx = device.index if device.index is not None else torch.cuda.current_device()
        env.update(gpu=p.name, cc=f"{p.major}.{p.minor}", sm_count=p.multi_processor_count,
                   gpu_mem_gib=round(p.total_memory / 2**30, 1))
        drv = nvidia_smi(("driver_version",), idx)
        env["driver"] = drv.get("driver_version") if drv else None
        env.update(sm_clocks(idx))
    env["versions"] = dict(impl_versions or {})
    return env


def slug(text: str | None) -> str:
    s = re.sub(r"[^a-z0-9]+", "-", (text or "cpu").lower()).strip("-")
    return s or "unknown"


def default_out_dir(env: dict) -> Path:
    """perf/results/<date>-<gpu>/"""
    date = (env.get("date") or _dt.date.today().isoformat())[:10]
    return REPO_ROOT / "perf" / "results" / f"{date}-{slug(env.get('gpu'))}"
