"""Which GPUs may this job use? Parse the vendors' smi tools, apply the visibility variables.

Standard library only: the launchers call this before anything imports torch (and on login
nodes where torch may be missing). The smi tools list every GPU in the machine and ignore
``CUDA_VISIBLE_DEVICES`` / ``HIP_VISIBLE_DEVICES`` / ``ROCR_VISIBLE_DEVICES``, so the rules the
CUDA and HIP runtimes apply to those variables are re-implemented here (``visible_gpus``), and
the launcher cross-checks the result with ``torch.cuda.device_count()`` when torch is there.

Formats parsed (see docs/launchers.md and ../shared/VENDOR_ENV.md):
  nvidia-smi --query-gpu=index,name,uuid,memory.total --format=csv,noheader,nounits
      0, NVIDIA H100 80GB HBM3, GPU-8f2b6c1e-..., 81559
  nvidia-smi -L
      GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-8f2b6c1e-...)
        MIG 1g.10gb     Device  0: (UUID: MIG-...)
  rocm-smi --showid --csv
      device,Device Name,Device ID,Device Rev,Subsystem ID,GUID
      card0,AMD Instinct MI300X,0x74a1,0x00,0x74a1,28851
  rocm-smi --showid
      GPU[0]\t\t: Device Name: \t\tAMD Instinct MI300X
  rocm-smi --showmeminfo vram --csv
      device,VRAM Total Memory (B),VRAM Total Used Memory (B)
      card0,206141652992,300589056
  amd-smi static --asic --vram --json      (names and memory where rocm-smi is missing)
      [{"gpu": 0, "asic": {"market_name": "AMD Instinct MI300X", …}, "vram": {"size": {"value": 196592, "unit": "MB"}}}]
  amd-smi list
      GPU: 0
          BDF: 0000:05:00.0
          UUID: afff74a1-0000-1000-8054-e92b0a5d57c8
"""

from __future__ import annotations

import csv
import io
import json
import re
import subprocess
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

NVIDIA = "nvidia"
AMD = "amd"
VENDORS = (NVIDIA, AMD)
VENDOR_LABEL = {NVIDIA: "NVIDIA", AMD: "AMD"}

# nvidia-smi exit codes (nvidia-smi(1), "RETURN VALUE"); 127 is the shell's "not found".
NVIDIA_SMI_EXIT = {
    2: "invalid argument",
    3: "operation not available",
    4: "insufficient permissions",
    6: "query unsuccessful",
    9: "NVIDIA driver not loaded",
    10: "NVIDIA kernel detected an interrupt issue with a GPU",
    12: "NVML shared library not found",
    14: "infoROM corrupted",
    15: "GPU has fallen off the bus",
    18: "driver/library version mismatch",
    127: "nvidia-smi not installed",
    255: "other error or internal driver error",
}


@dataclass(frozen=True)
class Gpu:
    """One device as its smi tool lists it. ``index`` is the tool's index (PCI bus order)."""

    index: int
    name: str = ""
    uuid: str = ""  # NVIDIA "GPU-…" or "MIG-…"; AMD the amd-smi UUID
    memory_mib: int | None = None

    @property
    def serial(self) -> str:
        """AMD: the 64-bit unique id ROCr and HIP accept as ``GPU-<serial>``, '' when unknown.

        amd-smi builds its UUID from that serial (amd_smi_uuid.cc): byte 7 is the first two hex
        digits, byte 6 the two after the third dash, bytes 0-5 the last twelve.
        """
        m = re.fullmatch(
            r"([0-9a-f]{2})[0-9a-f]{6}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{2}([0-9a-f]{2})-([0-9a-f]{12})",
            self.uuid.lower(),
        )
        return "".join(m.groups()) if m else ""

    def describe(self) -> str:
        mem = f", {self.memory_mib / 1024:.0f} GiB" if self.memory_mib else ""
        return f"{self.index}: {self.name or 'unnamed GPU'}{mem}"


def summarize(gpus: Sequence[Gpu]) -> str:
    """'0-3,6: NVIDIA H100 80GB HBM3, 80 GiB' - one entry per kind of GPU, indices compacted."""
    groups: dict[str, list[int]] = {}
    for g in gpus:
        groups.setdefault(g.describe().split(": ", 1)[1], []).append(g.index)
    return "; ".join(f"{_ranges(ix)}: {kind}" for kind, ix in groups.items())


def _ranges(ix: Sequence[int]) -> str:
    out: list[str] = []
    for i in ix:
        if out and int(out[-1].split("-")[-1]) == i - 1:
            out[-1] = f"{out[-1].split('-')[0]}-{i}"
        else:
            out.append(str(i))
    return ",".join(out)


@dataclass
class Probe:
    """What one vendor's tools say about the machine."""

    vendor: str
    gpus: list[Gpu] = field(default_factory=list)
    migs: list[Gpu] = field(default_factory=list)  # NVIDIA MIG instances (index = parent GPU)
    tool: str = ""  # the tool whose listing was used
    problem: str = ""  # why ``gpus`` is empty: no tool, driver failure, nothing listed


# A runner takes argv and returns (exit code, stdout, stderr); exit 127 when not installed.
Runner = Callable[[Sequence[str]], "tuple[int, str, str]"]


def run_tool(argv: Sequence[str], timeout: float = 30.0) -> tuple[int, str, str]:
    try:
        p = subprocess.run(list(argv), capture_output=True, text=True, timeout=timeout)
    except FileNotFoundError:
        return 127, "", f"{argv[0]}: command not found"
    except PermissionError as e:
        return 126, "", str(e)
    except subprocess.TimeoutExpired:
        return 124, "", f"{argv[0]} did not answer within {timeout:.0f} s"
    return p.returncode, p.stdout, p.stderr


# --------------------------------------------------------------------------------- parsers


def parse_nvidia_query(text: str) -> list[Gpu]:
    """``nvidia-smi --query-gpu=index,name,uuid,memory.total --format=csv,noheader,nounits``."""
    gpus = []
    for row in csv.reader(io.StringIO(text), skipinitialspace=True):
        if len(row) != 4 or not row[0].strip().isdigit():
            continue
        index, name, uuid, mem = (c.strip() for c in row)
        gpus.append(Gpu(int(index), name, uuid, int(mem) if mem.isdigit() else None))
    return gpus


_NVIDIA_L_GPU = re.compile(r"^GPU (\d+): (.*?) \(UUID: (GPU-[^)]+)\)\s*$")
_NVIDIA_L_MIG = re.compile(r"^\s+(MIG .*?)\s+Device\s+(\d+): \(UUID: (MIG-[^)]+)\)\s*$")


def parse_nvidia_list(text: str) -> tuple[list[Gpu], list[Gpu]]:
    """``nvidia-smi -L``: (GPUs, MIG instances); a MIG instance's index is its parent GPU's."""
    gpus, migs = [], []
    for line in text.splitlines():
        if m := _NVIDIA_L_GPU.match(line):
            gpus.append(Gpu(int(m[1]), m[2], m[3]))
        elif (m := _NVIDIA_L_MIG.match(line)) and gpus:
            migs.append(Gpu(gpus[-1].index, m[1], m[3]))
    return gpus, migs


def parse_rocm_showid_csv(text: str) -> list[Gpu]:
    """``rocm-smi --showid --csv``: a ``device,Device Name,…`` header then ``cardN,…`` rows."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("device,")), None)
    if start is None:
        return []
    gpus = []
    for row in csv.DictReader(lines[start:]):
        m = re.fullmatch(r"card(\d+)", (row.get("device") or "").strip())
        if m:
            gpus.append(Gpu(int(m[1]), (row.get("Device Name") or "").strip()))
    return gpus


_ROCM_LOG = re.compile(r"^GPU\[(\d+)\]\s*:\s*([^:]+?):\s*(.*?)\s*$")


def parse_rocm_showid(text: str) -> list[Gpu]:
    """``rocm-smi --showid``: ``GPU[0]\\t\\t: Device Name: \\t\\tAMD Instinct MI300X`` lines."""
    names: dict[int, str] = {}
    for line in text.splitlines():
        if m := _ROCM_LOG.match(line):
            index, key, value = int(m[1]), m[2].strip(), m[3].strip()
            names.setdefault(index, "")
            if key == "Device Name":
                names[index] = value
    return [Gpu(i, n) for i, n in sorted(names.items())]


def parse_rocm_vram_csv(text: str) -> dict[int, int]:
    """``rocm-smi --showmeminfo vram --csv``: {card index: total MiB}."""
    lines = [ln for ln in text.splitlines() if ln.strip()]
    start = next((i for i, ln in enumerate(lines) if ln.startswith("device,")), None)
    out: dict[int, int] = {}
    if start is None:
        return out
    for row in csv.DictReader(lines[start:]):
        m = re.fullmatch(r"card(\d+)", (row.get("device") or "").strip())
        total = (row.get("VRAM Total Memory (B)") or "").strip()
        if m and total.isdigit():
            out[int(m[1])] = int(total) // 2**20
    return out


def parse_amd_smi_list(text: str) -> list[Gpu]:
    """``amd-smi list``: ``GPU: 0`` blocks with indented ``BDF:``, ``UUID:``… lines."""
    gpus: list[Gpu] = []
    for line in text.splitlines():
        if m := re.match(r"^GPU:\s*(\d+)\s*$", line):
            gpus.append(Gpu(int(m[1])))
        elif gpus and (m := re.match(r"^\s+UUID:\s*(\S+)\s*$", line)):
            gpus[-1] = Gpu(gpus[-1].index, uuid=m[1])
    return gpus


_UNIT_MIB = {"B": 2**-20, "KB": 2**-10, "MB": 1, "GB": 2**10}  # amd-smi's "MB" are MiB (196592 on a 192 GiB MI300X)


def parse_amd_smi_static(text: str) -> list[Gpu]:
    """``amd-smi static --asic --vram --json``: names and memory where rocm-smi is missing (deprecated in ROCm
    6.4+). ROCm 6.x prints a list of ``{"gpu": 0, "asic": {"market_name": …}, "vram": {"size": {"value": 196592,
    "unit": "MB"}}}``; 7.x wraps it as ``{"gpu_data": […]}`` with ``vram_size``; some print ``"size": "196592 MB"``."""
    try:
        data = json.loads(text)
    except ValueError:
        return []
    rows = data.get("gpu_data", []) if isinstance(data, dict) else data
    gpus = []
    for row in rows if isinstance(rows, list) else []:
        if not isinstance(row, dict) or not isinstance(row.get("gpu"), int):
            continue
        asic, vram = row.get("asic") or {}, row.get("vram") or {}
        name = str(asic.get("market_name") or "").strip()
        gpus.append(Gpu(row["gpu"], "" if name == "N/A" else name, memory_mib=_amd_smi_mib(vram)))
    return gpus


def _amd_smi_mib(vram: dict) -> int | None:
    """``{"value": 196592, "unit": "MB"}`` or ``"196592 MB"`` (a bare number: MB) → MiB; None when not given."""
    size = vram.get("size", vram.get("vram_size"))
    if isinstance(size, dict):
        value, unit = size.get("value"), str(size.get("unit") or "MB")
    else:
        value, _, unit = str(size or "").partition(" ")
    try:
        return int(float(value) * _UNIT_MIB[(unit or "MB").strip().upper()])
    except (TypeError, ValueError, KeyError):
        return None


# ---------------------------------------------------------------------------------- probes


def _failure(tool: str, rc: int, err: str, meanings: Mapping[int, str] | None = None) -> str:
    if rc == 127:
        return f"{tool} not found: no driver installed"
    why = (meanings or {}).get(rc) or (err.strip().splitlines() or ["no output"])[-1].strip()
    return f"{tool} failed with exit {rc}: {why}"


def probe_nvidia(run: Runner = run_tool, want_migs: bool = False) -> Probe:
    """List NVIDIA GPUs with nvidia-smi; a non-zero exit or no GPU line means none."""
    probe = Probe(NVIDIA)
    rc, out, err = run(["nvidia-smi", "--query-gpu=index,name,uuid,memory.total", "--format=csv,noheader,nounits"])
    if rc == 0 and (gpus := parse_nvidia_query(out)):
        probe.gpus, probe.tool = gpus, "nvidia-smi"
    if rc == 127:
        probe.problem = _failure("nvidia-smi", rc, err)
        return probe
    if not probe.gpus or want_migs:
        rc_l, out_l, err_l = run(["nvidia-smi", "-L"])
        listed, probe.migs = parse_nvidia_list(out_l) if rc_l == 0 else ([], [])
        if not probe.gpus and listed:
            probe.gpus, probe.tool = listed, "nvidia-smi -L"
        if not probe.gpus:
            rc, err = (rc, err) if rc != 0 else (rc_l, err_l)
            probe.problem = _failure("nvidia-smi", rc, err, NVIDIA_SMI_EXIT) if rc != 0 else "nvidia-smi lists no GPU"
    return probe


def probe_amd(run: Runner = run_tool) -> Probe:
    """List AMD GPUs with rocm-smi (names, memory) and amd-smi (UUIDs; names and memory where rocm-smi is missing).

    rocm-smi without the amdgpu driver exits 0 with nothing on stdout, and amd-smi exits 255,
    so the listings are parsed rather than trusting exit codes.
    """
    probe = Probe(AMD)
    problems = []
    rc, out, err = run(["rocm-smi", "--showid", "--csv"])
    named = parse_rocm_showid_csv(out) if rc == 0 else []
    if not named and rc != 127:
        rc2, out2, err2 = run(["rocm-smi", "--showid"])
        named = parse_rocm_showid(out2) if rc2 == 0 else []
        rc, err = (rc2, err2) if rc == 0 else (rc, err)
    if not named:
        problems.append(
            _failure("rocm-smi", rc, err)
            if rc != 0
            else "rocm-smi lists no GPU" + (f": {err.strip().splitlines()[-1]}" if err.strip() else "")
        )
    rc_a, out_a, err_a = run(["amd-smi", "list"])
    listed = parse_amd_smi_list(out_a) if rc_a == 0 else []
    if not listed:
        problems.append(_failure("amd-smi", rc_a, err_a) if rc_a != 0 else "amd-smi lists no GPU")

    memory: dict[int, int] = {}
    from_rocm_smi = bool(named)
    if named:
        rc_m, out_m, _ = run(["rocm-smi", "--showmeminfo", "vram", "--csv"])
        memory = parse_rocm_vram_csv(out_m) if rc_m == 0 else {}
    elif listed:  # amd-smi alone: names (the MI300X tuning depends on them) and memory from its static listing
        rc_s, out_s, _ = run(["amd-smi", "static", "--asic", "--vram", "--json"])
        details = parse_amd_smi_static(out_s) if rc_s == 0 else []
        named = [g for g in details if g.name]
        memory = {g.index: g.memory_mib for g in details if g.memory_mib}
    uuids = {g.index: g.uuid for g in listed}
    names = {g.index: g.name for g in named}
    indices = sorted(set(names) | set(uuids))
    probe.gpus = [Gpu(i, names.get(i, ""), uuids.get(i, ""), memory.get(i)) for i in indices]
    probe.tool = " + ".join(t for t, ok in (("rocm-smi", from_rocm_smi), ("amd-smi", listed)) if ok)
    if not probe.gpus:
        probe.problem = "; ".join(problems)
    return probe


def probe(vendor: str, run: Runner = run_tool, env: Mapping[str, str] | None = None) -> Probe:
    if vendor == NVIDIA:  # nvidia-smi -L too: a GPU in MIG mode is used through its instances' MIG- ids
        return probe_nvidia(run, want_migs=True)
    if vendor == AMD:
        return probe_amd(run)
    raise ValueError(f"unknown vendor {vendor!r} (valid: {', '.join(VENDORS)})")


# ------------------------------------------------------------------------------ visibility


def _strtoul(s: str) -> int:
    """Leading integer of ``s`` like C's strtoul as the runtimes use it ('1gpu' -> 1); -1 if none."""
    m = re.match(r"[+-]?\d+", s)
    return int(m[0]) if m else -1


def apply_visibility_list(value: str, candidates: Sequence[Gpu], vendor: str) -> tuple[list[Gpu], str]:
    """Apply one visibility variable's value to ``candidates`` (what is visible so far, in order).

    Rules of the CUDA and HIP runtimes (and of torch's re-implementation): ``""`` hides every
    GPU; entries are indices into ``candidates`` or UUIDs (``GPU-…``/``MIG-…``, prefixes
    accepted, the first entry decides which kind the list is); the first entry that is not a
    GPU here (negative, out of range, unknown or ambiguous UUID, junk) ends the list; a repeated
    GPU makes the whole list empty. Returns the GPUs and a note when the value was cut short.
    """
    if value.strip() == "":
        return [], "hides every GPU"
    items = [s.strip() for s in value.split(",")]
    by_uuid = items[0].upper().startswith(("GPU-", "MIG-"))
    chosen: list[Gpu] = []
    for item in items:
        gpu = None
        if by_uuid:
            if item.upper().startswith(("GPU-", "MIG-")):
                gpu = _match_uuid(item, candidates, vendor)
        else:
            n = _strtoul(item)
            if 0 <= n < len(candidates):
                gpu = candidates[n]
        if gpu is None:
            return chosen, f"stops at {item!r} (not a GPU here), so {len(chosen)} remain"
        if gpu in chosen:
            return [], f"names {item!r} twice, which hides every GPU"
        chosen.append(gpu)
    return chosen, ""


def _match_uuid(item: str, candidates: Sequence[Gpu], vendor: str) -> Gpu | None:
    if vendor == AMD:  # ROCr/HIP take GPU-<serial>; amd-smi prints a UUID built from it
        want = item[4:].lower()
        hits = [g for g in candidates if g.serial and g.serial.startswith(want)]
    else:
        hits = [g for g in candidates if g.uuid and g.uuid.startswith(item)]
    return hits[0] if len(hits) == 1 else None


@dataclass
class Visibility:
    gpus: list[Gpu]  # usable GPUs in the order the runtime numbers them (cuda:0, cuda:1, …)
    notes: list[str]  # one line per variable that changed the set
    variables: dict[str, str]  # the visibility variables that applied, with their values
    unresolved: str = ""  # set when the rules cannot be applied from the smi data (e.g. AMD UUIDs)


def hide_all(vendor: str | None = None) -> dict[str, str]:
    """The variables that hide every GPU of ``vendor`` (None: of both) from a process.

    An empty ``HIP_VISIBLE_DEVICES`` is treated as unset by HIP, so on AMD ``ROCR_VISIBLE_DEVICES=""``
    (read by the ROCm runtime underneath) does the hiding; the others keep torch's view consistent.
    """
    return dict.fromkeys(visibility_variables(vendor) if vendor else VISIBILITY_VARIABLES, "")


def with_mig_instances(gpus: Sequence[Gpu], migs: Sequence[Gpu]) -> list[Gpu]:
    """Each GPU in MIG mode replaced by its instances (a process computes on an instance, never on the parent)."""
    out: list[Gpu] = []
    for g in gpus:
        out += [m for m in migs if m.index == g.index] or [g]
    return out


VISIBILITY_VARIABLES = ("CUDA_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES")  # every vendor's


def visibility_variables(vendor: str) -> tuple[str, ...]:
    """The variables the vendor's runtime reads, in the order it applies them."""
    return (
        ("CUDA_VISIBLE_DEVICES",)
        if vendor == NVIDIA
        else ("ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES", "CUDA_VISIBLE_DEVICES")
    )


def visible_gpus(vendor: str, present: Sequence[Gpu], env: Mapping[str, str], migs: Sequence[Gpu] = ()) -> Visibility:
    """The GPUs a process started with ``env`` may use, in runtime order.

    NVIDIA: ``CUDA_VISIBLE_DEVICES`` indexes the GPUs (in nvidia-smi's PCI order when
    ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, which the launcher sets). AMD: ``ROCR_VISIBLE_DEVICES``
    filters first (Slurm sets it), then ``HIP_VISIBLE_DEVICES`` - or, when that is unset,
    ``CUDA_VISIBLE_DEVICES`` - indexes what remains; ``ROCR=1 CUDA=1`` leaves no GPU.
    """
    seen: list[Gpu] = list(present)
    notes: list[str] = []
    applied: dict[str, str] = {}
    unresolved = ""
    if vendor == NVIDIA:
        steps = ["CUDA_VISIBLE_DEVICES"] if "CUDA_VISIBLE_DEVICES" in env else []
        if not steps:
            seen = with_mig_instances(seen, migs)
    else:
        steps = [v for v in ("ROCR_VISIBLE_DEVICES",) if v in env]
        if env.get("HIP_VISIBLE_DEVICES", "").strip():  # HIP treats an empty value as unset
            steps.append("HIP_VISIBLE_DEVICES")
        elif "CUDA_VISIBLE_DEVICES" in env:
            steps.append("CUDA_VISIBLE_DEVICES")
    for var in steps:
        value = env[var]
        applied[var] = value
        pool: Sequence[Gpu] = seen
        if vendor == NVIDIA and value.strip().upper().startswith("MIG-"):
            pool = list(migs)
            if not migs:
                unresolved = f"{var}={value!r} names MIG instances, but nvidia-smi -L lists none"
        if vendor == AMD and value.strip().upper().startswith("GPU-") and not all(g.serial for g in seen):
            unresolved = f"{var}={value!r} names UUIDs, which need amd-smi's listing to resolve"
        before = len(seen)
        seen, note = apply_visibility_list(value, pool, vendor)
        if note or len(seen) != before:
            notes.append(f"{var}={value!r} " + (note or f"leaves {len(seen)} of {before}"))
    return Visibility(seen, notes, applied, unresolved)
