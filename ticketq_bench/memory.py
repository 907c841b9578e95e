"""Peak resident memory of a mode: reset before it runs, read after (Linux /proc, else getrusage or psutil)."""

from __future__ import annotations

import re
import resource
import sys
from pathlib import Path


def reset_peak_rss() -> bool:
    """Reset this process's peak RSS (Linux: clear_refs 5), so each mode reports its own peak."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
        return True
    except OSError:
        return False


def peak_rss_mb(pid: int | str) -> float | None:
    """Peak RSS in MiB: VmHWM from /proc, else getrusage (self) or current RSS via psutil."""
    try:
        match = re.search(r"VmHWM:\s+(\d+) kB", Path(f"/proc/{pid}/status").read_text())
        if match:
            return int(match.group(1)) / 1024
    except OSError:
        pass
    if pid == "self":
        maxrss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return maxrss / 2**20 if sys.platform == "darwin" else maxrss / 1024  # bytes on macOS, KiB elsewhere
    import psutil

    try:
        return psutil.Process(int(pid)).memory_info().rss / 2**20
    except psutil.Error:
        return None


def weights_mb(*models) -> float:
    """MiB of the tensors `models` hold (parameters, buffers and oneDNN-packed weights), each storage
    counted once: what a mode keeps resident whatever else the bench process has loaded (its peak RSS
    cannot tell two engines in one process apart)."""
    import torch

    seen: dict[int, int] = {}
    for model in models:
        for module in model.modules():
            tensors = [*module.parameters(recurse=False), *module.buffers(recurse=False)]
            tensors += [value for value in vars(module).values() if isinstance(value, torch.Tensor)]
            for tensor in tensors:
                if tensor.is_mkldnn:  # an opaque packed weight: no storage to share, its own bytes
                    seen[id(tensor)] = tensor.numel() * tensor.element_size()
                else:
                    storage = tensor.untyped_storage()
                    seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values()) / 2**20
