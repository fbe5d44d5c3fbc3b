"""What a measurement ran on: recorded with every benchmark and tuning result, since speed figures
compare only within one machine (CPU model and vector extensions, threads, library versions)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def cpu_flags() -> list[str]:
    """The CPU's vector-extension flags (AVX2, AVX-512 and its BF16/VNNI parts, AMX), sorted."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split() if f.startswith(("avx", "amx", "fma")))
    except OSError:
        pass
    return []


def machine_info(dtype: torch.dtype, device: str) -> dict:
    import transformers

    cpu = platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_flags": cpu_flags(),
        "cpu_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "dtype": str(dtype).replace("torch.", ""),
        "device": device,
    }
    if torch.cuda.is_available() and device.startswith("cuda"):
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
