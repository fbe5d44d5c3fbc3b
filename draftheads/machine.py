"""What a measurement ran on: recorded with every benchmark and tuning result, since speed figures
compare only within one machine (CPU model and vector extensions, threads, library versions)."""

from __future__ import annotations

import platform
from pathlib import Path

import torch


def _cpuinfo_field(name: str) -> str | None:
    """The first ``name : value`` line of /proc/cpuinfo (None where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(name):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return _cpuinfo_field("model name") or platform.processor()


def cpu_flags() -> list[str]:
    """The CPU's vector-extension flags (AVX2, AVX-512 and its BF16/VNNI parts, AMX), sorted."""
    flags = (_cpuinfo_field("flags") or "").split()
    return sorted(f for f in flags if f.startswith(("avx", "amx", "fma")))


NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # /proc/cpuinfo flags of native bf16 dot products


def native_bf16() -> bool:
    """Whether this CPU computes bf16 dot products natively (AVX512_BF16 or AMX-BF16); without,
    PyTorch emulates them and bf16 matmuls are slower than fp32."""
    flags = set(cpu_flags())
    return any(flag in flags for flag in NATIVE_BF16_FLAGS)


def machine_info(dtype: torch.dtype, device: str) -> dict:
    import transformers

    info = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu": cpu_name(),
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
