"""Fake nvidia-smi, rocm-smi, amd-smi and scontrol for the launcher tests.

They print the real tools' formats (see ../../anygpu/launch/detect.py and VENDOR_ENV.md) for
FAKE_GPUS GPUs (default 8). Modes, per tool:
  FAKE_NVIDIA = ok | driver-fail | absent     (default ok)
  FAKE_AMD    = ok | driver-fail | absent     (default ok; drives rocm-smi and amd-smi)
ok lists the GPUs; driver-fail behaves like the tool without a working driver (nvidia-smi:
exit 9, empty stdout; rocm-smi: exit 0, empty stdout, an error on stderr; amd-smi: exit 255,
empty stdout); absent behaves like a missing binary (exit 127, as the shell reports it).
FAKE_ROCM_SMI = absent: rocm-smi alone is missing (ROCm 6.4+ deprecates it), amd-smi answers as FAKE_AMD says.
FAKE_MIG=K (default 0): nvidia-smi -L lists K MIG instances under each GPU, as on GPUs in MIG mode.
FAKE_SMI_LOG, when set, is a file each call appends its argv to.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys

NVIDIA_NAME = "NVIDIA H100 80GB HBM3"
NVIDIA_MIB = 81559
AMD_NAME = "AMD Instinct MI300X"
AMD_DID = 0x74A1
AMD_VRAM_B = 205822885888


def count() -> int:
    return int(os.environ.get("FAKE_GPUS", "8"))


def _hex(seed: str, n: int) -> str:
    return hashlib.sha256(seed.encode()).hexdigest()[:n]


def nvidia_uuid(i: int) -> str:
    h = _hex(f"nvidia{i}", 32)
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def mig_uuid(i: int, j: int) -> str:
    """The UUID of MIG instance ``j`` of GPU ``i``."""
    h = _hex(f"mig{i}.{j}", 32)
    return f"MIG-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def amd_serial(i: int) -> int:
    return int(_hex(f"amd{i}", 16), 16)


def amd_uuid(i: int) -> str:
    """amd-smi's UUID as amd_smi_uuid.cc prints it from the 64-bit serial and the device id."""
    s = amd_serial(i)
    b7, b6, b45, b03 = (s >> 56) & 0xFF, (s >> 48) & 0xFF, (s >> 32) & 0xFFFF, s & 0xFFFFFFFF
    return f"{b7:02x}ff{AMD_DID:04x}-0000-1000-80{b6:02x}-{b45:04x}{b03:08x}"


def spacer(text: str = "", width: int = 90) -> str:
    if not text:
        return "=" * width
    if len(text) % 2:
        text += "="
    side = "=" * ((width - len(text)) // 2)
    return side + text + side


def nvidia_smi(args: list[str]) -> int:
    mode = os.environ.get("FAKE_NVIDIA", "ok")
    if mode == "absent":
        print("nvidia-smi: command not found", file=sys.stderr)
        return 127
    if mode == "driver-fail":
        print(
            "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
            "Make sure that the latest NVIDIA driver is installed and running.",
            file=sys.stderr,
        )
        return 9
    if args == ["-L"]:
        for i in range(count()):
            print(f"GPU {i}: {NVIDIA_NAME} (UUID: {nvidia_uuid(i)})")
            for j in range(int(os.environ.get("FAKE_MIG", "0"))):
                print(f"  MIG 1g.10gb     Device  {j}: (UUID: {mig_uuid(i, j)})")
        return 0
    if args == ["--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits"]:
        for i in range(count()):
            print(f"{i}, {NVIDIA_NAME}, {nvidia_uuid(i)}, {NVIDIA_MIB}")
        return 0
    print(f"Invalid combination of input arguments: {' '.join(args)}", file=sys.stderr)
    return 2


def rocm_smi(args: list[str]) -> int:
    mode = "absent" if os.environ.get("FAKE_ROCM_SMI") == "absent" else os.environ.get("FAKE_AMD", "ok")
    if mode == "absent":
        print("rocm-smi: command not found", file=sys.stderr)
        return 127
    if mode == "driver-fail":
        print("ERROR:root:Driver not initialized (amdgpu not found in modules)", file=sys.stderr)
        return 0
    n = count()
    if args == ["--showid", "--csv"]:
        print("device,Device Name,Device ID,Device Rev,Subsystem ID,GUID")
        for i in range(n):
            print(f"card{i},{AMD_NAME},0x{AMD_DID:04x},0x00,0x{AMD_DID:04x},{28851 + 977 * i}")
        return 0
    if args == ["--showid"]:
        print("\n")
        print(spacer(" ROCm System Management Interface "))
        print(spacer(" ID "))
        for i in range(n):
            print(f"GPU[{i}]\t\t: Device Name: \t\t{AMD_NAME}")
            print(f"GPU[{i}]\t\t: Device ID: \t\t0x{AMD_DID:04x}")
            print(f"GPU[{i}]\t\t: Device Rev: \t\t0x00")
            print(f"GPU[{i}]\t\t: Subsystem ID: \t0x{AMD_DID:04x}")
            print(f"GPU[{i}]\t\t: GUID: \t\t{28851 + 977 * i}")
        print(spacer())
        print(spacer(" End of ROCm SMI Log "))
        return 0
    if args == ["--showmeminfo", "vram", "--csv"]:
        print("device,VRAM Total Memory (B),VRAM Total Used Memory (B)")
        for i in range(n):
            print(f"card{i},{AMD_VRAM_B},{283090944 + 4096 * i}")
        return 0
    print("usage: rocm-smi [-h] [-V] ... (fake: unsupported arguments " + " ".join(args) + ")", file=sys.stderr)
    return 1


def amd_smi(args: list[str]) -> int:
    mode = os.environ.get("FAKE_AMD", "ok")
    if mode == "absent":
        print("amd-smi: command not found", file=sys.stderr)
        return 127
    if mode == "driver-fail":
        print(
            "ERROR:root:Unable to detect any GPU devices, check amdgpu version and module status "
            "(sudo modprobe amdgpu)",
            file=sys.stderr,
        )
        return 255
    if args == ["list"]:
        blocks = []
        for i in range(count()):
            blocks.append(
                f"GPU: {i}\n"
                f"    BDF: 0000:{0x05 + 0x20 * i:02x}:00.0\n"
                f"    UUID: {amd_uuid(i)}\n"
                f"    KFD_ID: {45412 + 1117 * i}\n"
                f"    NODE_ID: {i + 2}\n"
                f"    PARTITION_ID: 0\n"
            )
        print("\n".join(blocks))
        return 0
    if args == ["static", "--asic", "--vram", "--json"]:  # ROCm 6.x layout: a list, one object per GPU
        static = [
            {
                "gpu": i,
                "asic": {
                    "market_name": AMD_NAME,
                    "device_id": f"0x{AMD_DID:04x}",
                    "asic_serial": f"0x{amd_serial(i):016X}",
                },
                "vram": {"type": "HBM", "vendor": "N/A", "size": {"value": AMD_VRAM_B // 2**20, "unit": "MB"}},
            }
            for i in range(count())
        ]
        print(json.dumps(static, indent=4))
        return 0
    print("amd-smi: error: unsupported arguments " + " ".join(args), file=sys.stderr)
    return 2


def expand_hostlist(text: str) -> list[str]:
    """Slurm hostlist expansion, enough for 'gpu[001-003,7],login1'."""
    hosts, parts, item, depth = [], [], "", 0
    for ch in text:
        depth += ch == "["
        depth -= ch == "]"
        if ch == "," and depth == 0:
            parts.append(item)
            item = ""
        else:
            item += ch
    parts.append(item)
    for part in filter(None, parts):
        if "[" not in part:
            hosts.append(part)
            continue
        prefix, ranges = part[:-1].split("[", 1)
        for r in ranges.split(","):
            lo, _, hi = r.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def scontrol(args: list[str]) -> int:
    if len(args) == 3 and args[:2] == ["show", "hostnames"]:
        print("\n".join(expand_hostlist(args[2])))
        return 0
    print("scontrol: error: fake supports only 'show hostnames LIST'", file=sys.stderr)
    return 1


TOOLS = {"nvidia-smi": nvidia_smi, "rocm-smi": rocm_smi, "amd-smi": amd_smi, "scontrol": scontrol}


def main(tool: str, args: list[str]) -> int:
    if os.environ.get("FAKE_SMI_LOG"):
        with open(os.environ["FAKE_SMI_LOG"], "a") as f:
            f.write(" ".join([tool, *args]) + "\n")
    return TOOLS[tool](args)
