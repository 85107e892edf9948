"""Device health where torch can see it: the device, its free memory, a matmul with a known
result, and the vendor's error counters.

The matmul multiplies two integer-valued matrices whose exact product is known (numpy sums its 35
distinct values in int64 on the host): on a healthy device the float32 product is exact (every
partial sum is an integer far below 2**24, in TF32 too), so any mismatch is a wrong answer, not
rounding.  It runs on the rank's device (the
CPU on a CPU job).  Counters: ``nvidia-smi`` (uncorrected and corrected volatile ECC errors, and
row remapping: uncorrectable remaps, pending remaps, remapping failures), else ``amd-smi`` or
``rocm-smi`` (their JSON, read by key name), else skipped with a note.  Uncorrected errors, a
pending remap or a failed remap fail the check; corrected errors are reported only.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
from typing import Any

import numpy as np
import torch

__all__ = [
    "device_info",
    "matmul_check",
    "matmul_sample",
    "vendor_counters",
    "parse_nvidia_ecc",
    "parse_nvidia_remap",
    "parse_amd_json",
]


def device_info(device: torch.device) -> dict[str, Any]:
    """What torch sees: the kind (cpu, cuda, or rocm), the device count, the name, free memory."""
    if device.type != "cuda":
        return {
            "kind": "cpu",
            "count": torch.cuda.device_count() if torch.cuda.is_available() else 0,
            "name": "cpu",
        }
    free, total = torch.cuda.mem_get_info(device)
    props = torch.cuda.get_device_properties(device)
    return {
        "kind": "rocm" if torch.version.hip else "cuda",
        "count": torch.cuda.device_count(),
        "index": device.index,
        "name": props.name,
        "free_bytes": int(free),
        "total_bytes": int(total),
        "pci_bus_id": _bus_id(props),
    }


def _bus_id(props: Any) -> str | None:
    try:
        return f"{props.pci_domain_id:08X}:{props.pci_bus_id:02X}:{props.pci_device_id:02X}.0"
    except AttributeError:
        return None


def _operands(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    i = torch.arange(n, device=device)
    a = ((i[:, None] + 2 * i[None, :]) % 7 - 3).to(torch.float32)  # entries in [-3, 3]
    b = ((3 * i[:, None] + i[None, :]) % 5 - 2).to(torch.float32)  # entries in [-2, 2]
    return a, b


def _expected(n: int, device: torch.device) -> torch.Tensor:
    """The exact product of ``_operands``: entry (i, j) depends only on i mod 7 and j mod 5, so
    numpy sums the 35 distinct values in int64 on the host (|value| <= 6n, exact in float32)."""
    k = np.arange(n, dtype=np.int64)
    table = np.array(
        [
            [int(((((ri + 2 * k) % 7) - 3) * (((3 * k + rj) % 5) - 2)).sum()) for rj in range(5)]
            for ri in range(7)
        ],
        dtype=np.float32,
    )
    t = torch.from_numpy(table).to(device)
    i = torch.arange(n, device=device)
    return t[(i % 7)[:, None], (i % 5)[None, :]]


def matmul_check(device: torch.device, n: int) -> dict[str, Any]:
    """Multiply on ``device`` and compare with the exact product (ok, mismatches, worst error)."""
    a, b = _operands(n, device)
    got = a @ b
    expected = _expected(n, device)
    wrong = int((got != expected).sum())
    worst = float((got - expected).abs().max()) if wrong else 0.0
    return {"n": n, "ok": wrong == 0, "mismatches": wrong, "max_error": worst}


def matmul_sample(device: torch.device, n: int, sample_s: float) -> float:
    """Floating-point operations per second of ``n x n`` float32 matmuls over one sample."""
    a, b = _operands(n, device)
    out = torch.empty_like(a)
    torch.matmul(a, b, out=out)
    count, t0 = 0, time.perf_counter()
    while True:
        torch.matmul(a, b, out=out)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        count += 1
        elapsed = time.perf_counter() - t0
        if elapsed >= sample_s:
            return count * 2 * n**3 / elapsed


# --- vendor counters -----------------------------------------------------------------------------


def _int(text: str) -> int | None:
    text = text.strip()
    return int(text) if text.isdigit() else None  # "[N/A]", "[Not Supported]", "N/A"


def parse_nvidia_ecc(csv: str) -> list[dict[str, Any]]:
    """``nvidia-smi --query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,
    ecc.errors.corrected.volatile.total --format=csv,noheader,nounits``: one dict per GPU."""
    out = []
    for line in csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 4:
            continue
        out.append(
            {
                "index": _int(parts[0]),
                "pci_bus_id": parts[1],
                "uncorrected": _int(parts[2]),
                "corrected": _int(parts[3]),
            }
        )
    return out


def parse_nvidia_remap(csv: str) -> dict[str, dict[str, Any]]:
    """``nvidia-smi --query-remapped-rows=gpu_bus_id,remapped_rows.correctable,
    remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure --format=csv,noheader``:
    bus id -> counters (pending and failure are yes/no or 0/1 depending on the driver)."""
    out = {}
    for line in csv.strip().splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) < 5:
            continue

        def flag(s: str) -> bool | None:
            s = s.lower()
            return True if s in ("yes", "1") else False if s in ("no", "0") else None

        out[parts[0]] = {
            "remapped_correctable": _int(parts[1]),
            "remapped_uncorrectable": _int(parts[2]),
            "remap_pending": flag(parts[3]),
            "remap_failure": flag(parts[4]),
        }
    return out


def parse_amd_json(text: str) -> dict[str, int]:
    """``amd-smi metric --ecc --json`` or ``rocm-smi --showrasinfo --json``: the sums of every
    integer under a key that names uncorrectable or correctable errors (their layouts differ by
    version, the key names do not)."""
    totals = {"uncorrected": 0, "corrected": 0}

    def walk(node: Any, key: str = "") -> None:
        if isinstance(node, dict):
            for k, v in node.items():
                walk(v, str(k).lower())
        elif isinstance(node, list):
            for v in node:
                walk(v, key)
        else:
            value = _int(str(node))
            if value is None:
                return
            if "uncorrectable" in key or key.endswith("_ue") or key == "ue":
                totals["uncorrected"] += value
            elif "correctable" in key or key.endswith("_ce") or key == "ce":
                totals["corrected"] += value

    walk(json.loads(text))
    return totals


def _run(cmd: list[str]) -> str | None:
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=20)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout if done.returncode == 0 else None


def vendor_counters(info: dict[str, Any]) -> dict[str, Any]:
    """The error counters of this rank's GPU from the vendor tool: ``{"tool", "counters",
    "failures", "note"}``; a CPU rank or a host without the tool gets a note only."""
    if info["kind"] == "cpu":
        return {"tool": None, "note": "no GPU on this rank: ECC and row-remap counters skipped"}
    if info["kind"] == "cuda" and shutil.which("nvidia-smi"):
        return _nvidia(info)
    for tool, cmd in (
        ("amd-smi", ["amd-smi", "metric", "--ecc", "--json"]),
        ("rocm-smi", ["rocm-smi", "--showrasinfo", "all", "--json"]),
    ):
        if info["kind"] == "rocm" and shutil.which(tool):
            text = _run(cmd)
            if text is None:
                return {"tool": tool, "note": f"`{' '.join(cmd)}` failed: counters skipped"}
            try:
                counters = parse_amd_json(text)
            except ValueError:
                return {"tool": tool, "note": f"`{' '.join(cmd)}` printed no JSON: skipped"}
            return _judge(tool, counters, "the node's GPUs (summed)")
    tools = "nvidia-smi" if info["kind"] == "cuda" else "amd-smi or rocm-smi"
    return {"tool": None, "note": f"{tools} not found: ECC and row-remap counters skipped"}


def _nvidia(info: dict[str, Any]) -> dict[str, Any]:
    bus = info.get("pci_bus_id")
    select = ["-i", bus] if bus else []
    ecc_text = _run(
        [
            "nvidia-smi",
            *select,
            "--query-gpu=index,pci.bus_id,ecc.errors.uncorrected.volatile.total,"
            "ecc.errors.corrected.volatile.total",
            "--format=csv,noheader,nounits",
        ]
    )
    if ecc_text is None:
        return {"tool": "nvidia-smi", "note": "nvidia-smi failed: ECC counters skipped"}
    gpus = parse_nvidia_ecc(ecc_text)
    if not gpus:
        return {"tool": "nvidia-smi", "note": "nvidia-smi listed no GPU: ECC counters skipped"}
    gpu = gpus[0]
    counters: dict[str, Any] = {"uncorrected": gpu["uncorrected"], "corrected": gpu["corrected"]}
    remap_text = _run(
        [
            "nvidia-smi",
            *select,
            "--query-remapped-rows=gpu_bus_id,remapped_rows.correctable,"
            "remapped_rows.uncorrectable,remapped_rows.pending,remapped_rows.failure",
            "--format=csv,noheader",
        ]
    )
    remaps = parse_nvidia_remap(remap_text or "")
    if remaps:
        counters.update(next(iter(remaps.values())))
    what = f"GPU {gpu['index']} ({gpu['pci_bus_id']})"
    result = _judge("nvidia-smi", counters, what)
    if not remaps:
        result["note"] = "row remapping not reported by this GPU or driver"
    return result


def _judge(tool: str, counters: dict[str, Any], what: str) -> dict[str, Any]:
    failures = []
    if counters.get("uncorrected"):
        failures.append(
            f"{what}: {counters['uncorrected']} uncorrected ECC errors since the driver loaded "
            f"(expected 0); drain this node and have its GPU checked (reset or replace)"
        )
    if counters.get("remap_pending"):
        failures.append(
            f"{what}: a row remap is pending (expected none); reset the GPU to apply it before "
            f"training on it"
        )
    if counters.get("remap_failure"):
        failures.append(f"{what}: row remapping failed (expected none); the GPU needs replacing")
    return {"tool": tool, "device": what, "counters": counters, "failures": failures}
