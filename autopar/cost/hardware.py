"""Hardware profiles: what one device can do and how devices are wired.

A profile is a JSON file in `autopar/cost/profiles/` (or anywhere, by path): datasheet peaks
(FLOP/s per dtype, memory bandwidth and capacity), the topology (GPUs per node, nodes, the
intra-node link such as NVLink/NVSwitch and the inter-node link such as InfiniBand, each with
a per-GPU, per-direction bandwidth and a latency), efficiency factors (the fraction of a peak
that real kernels reach; defaults until `autopar tune` overwrites them), and the kernel
choices that decide what autograd saves (flash vs. math attention, fused vs. composite
RMSNorm, bool vs. dtype dropout masks), which differ between CUDA and CPU.

An optional `"host"` section (`{"bandwidth": B/s per direction device<->host, "memory_bandwidth":
B/s of CPU memory one device's optimizer step gets}`) prices offload; without one the
documented defaults DEFAULT_HOST_BANDWIDTH / DEFAULT_HOST_MEMORY_BANDWIDTH apply.

An optional `"compute"` section (autopar/cost/compute_tables.py) gives efficiency by shape:
GEMMs by (dtype, m, n, k), attention by (seq, head_dim, causal), and a per-kernel floor in
seconds. `Hardware.matmul_eff` / `attention_eff` / `kernel_floor` read it and fall back to the
flat "efficiency" factors (which stay required: hand-written profiles and the searches' quick
bounds use them) where it has no rows.

A profile may `"extends"` another by name; its keys are merged over the parent's (nested
dicts merge key by key). A profile that sets a flat efficiency.matmul or .attention of its own
without a compute table for that kind drops the table it inherits for that kind: the most
specific statement wins.

An optional `"contention"` section (`{"intra_node": k, "inter_node": k, "source": ...}`) gives
the compute slowdown under concurrent communication: while a collective on an axis of that
kind of link runs beside compute (ZeRO gathers, bucketed gradient reductions, pipeline
point-to-point), the compute runs (1 + k) times slower (`Hardware.contention_for`, read through
`cost.comm.AxisLink.contention`; `cost.overlap` applies it). Without one, 0: overlap is free.

`default_profile(device_type)` names the profile used when none is given.

It reads and writes no `node.meta` keys. Guarantees: `load_profile` returns a validated,
frozen `Hardware`, or raises `ValueError` naming the bad value or listing the known profiles.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Mapping

from .compute_tables import ComputeTable, table_from_dict

# host <-> device defaults for profiles without a "host" section (offload pricing)
DEFAULT_HOST_BANDWIDTH = 25e9  # bytes/s per direction: pinned copies over PCIe 4.0/5.0 x16 as typically measured, not the link's peak
DEFAULT_HOST_MEMORY_BANDWIDTH = 50e9  # bytes/s of CPU DRAM one device's optimizer step gets (a server's ~400 GB/s over 8 GPUs)
# host seconds per graph node of a selective checkpoint region, per pass (its forward and its
# recompute): torch's selective-checkpoint dispatch mode runs Python for every ATen op inside the
# region (about 2 ops per captured node), caching or replaying its output, and on a GPU that host
# time is exposed where it exceeds the kernels' (passes/recompute.py CheckpointRegion). Measured
# 2026-11-26 on the 2-core development host (torch 2.13): a 16-block GPT at width 64 trained 81 ms
# a step with every block selective against 43 ms fully checkpointed, 22 us per node per pass;
# torch.utils.checkpoint alone on a chain of small ops, 16-22 us per op over plain checkpointing.
# A profile's host section overrides it: h100-sxm 52 us (measured on an H100's host by `autopar
# tune`, 2026-11-27), cpu-gloo 15 us (the same item here, now that plain checkpointing's own host
# time is priced apart, `checkpoint_node_s`).
DEFAULT_SELECTIVE_NODE_S = 20e-6
# Host time per node of a checkpointed region beyond re-running its forward: torch.utils.checkpoint's
# saved-tensor hooks and the recompute replaying them (non-reentrant; passes/recompute.py). Measured
# 2026-11-27 on the 2-core development host (torch 2.13) by `autopar tune`'s "selective" item: a
# chain of 200 small ops, checkpointed, 2.82 ms a forward + backward against 1.14 ms plain and 0.45
# ms for one more forward: 12.3 us per node (2 ops). Not measured on a GPU host yet.
DEFAULT_CHECKPOINT_NODE_S = 12e-6

PROFILE_DIR = Path(__file__).with_name("profiles")

# what the kernel keys may say (see autopar/cost/saved.py for their effect)
KERNEL_CHOICES = {
    "sdpa": ("flash", "cpu", "math"),  # flash: CUDA flash/efficient; cpu: flash unless dropout; math: always math
    "sdpa_math_upcast": (True, False),  # math attention computes fp16/bf16 inputs in fp32 (torch default)
    "rms_norm": ("fused", "composite"),
    "dropout_mask": ("bool", "input_dtype"),
    "layer_norm_stats": ("acc", "input_dtype"),
}
EFFICIENCY_KEYS = ("matmul", "attention", "vector", "memory", "intra_node", "inter_node")
CONTENTION_KEYS = ("intra_node", "inter_node")  # the links a collective can run on
MAX_CONTENTION = 4.0  # compute 5x slower under communication: beyond anything published (see h100-sxm.json)


@dataclass(frozen=True)
class Link:
    """One kind of wire: bandwidth in bytes/s per GPU per direction, latency (alpha) in s."""

    name: str
    bandwidth: float
    latency: float

    def __post_init__(self):
        if not self.bandwidth > 0 or not self.latency >= 0:
            raise ValueError(f"link {self.name!r} needs bandwidth > 0 and latency >= 0, "
                             f"got bandwidth={self.bandwidth!r}, latency={self.latency!r}")


@dataclass(frozen=True)
class Device:
    name: str
    kind: str  # "cuda" | "cpu"
    memory_bytes: float
    peak_flops: Mapping[str, float]  # dtype name -> dense FLOP/s ("bf16", "fp16", "fp32", "tf32", ...)
    memory_bandwidth: float  # bytes/s
    vector_flops: float  # FLOP/s of non-matmul (elementwise, reduction) work


@dataclass(frozen=True)
class Hardware:
    name: str
    device: Device
    gpus_per_node: int
    nodes: int
    intra_node: Link
    inter_node: Link
    efficiency: Mapping[str, float]
    kernels: Mapping[str, Any]
    fp32_matmul: str = "fp32"  # "fp32" or "tf32": which peak an fp32 matmul runs at
    kernel_overhead_s: float = 0.0  # launch cost per non-view kernel
    description: str = ""
    calibration: Mapping[str, Any] = field(default_factory=dict)
    # host <-> device (offload): copy bandwidth per direction and the CPU memory bandwidth one
    # device's optimizer step gets; a profile's optional "host" section, else the documented
    # defaults above
    host_bandwidth: float = DEFAULT_HOST_BANDWIDTH
    host_memory_bandwidth: float = DEFAULT_HOST_MEMORY_BANDWIDTH
    selective_node_s: float = DEFAULT_SELECTIVE_NODE_S  # the "host" section's selective_checkpoint_node_s
    checkpoint_node_s: float = DEFAULT_CHECKPOINT_NODE_S  # the "host" section's checkpoint_node_s
    compute: ComputeTable | None = None  # efficiency by shape; None: the flat factors alone
    # compute slowdown while a collective overlaps it, per link kind: compute time x (1 + k)
    # over the overlapped interval (the profile's optional "contention" section; 0: none)
    contention: Mapping[str, float] = field(default_factory=lambda: {k: 0.0 for k in CONTENTION_KEYS})
    # sustained / burst throughput of GEMMs and attention for the work being costed (the compute
    # table's power rows at its GEMM duty, `cost.power.sustained`); 1: bursts, as the tables
    power_ratio: float = 1.0
    power_duty: float | None = None  # the GEMM duty that ratio was read at (None: not set from a graph)

    @property
    def world_size(self) -> int:
        return self.gpus_per_node * self.nodes

    def peak(self, dtype_name: str) -> float:
        """Dense matmul FLOP/s for a dtype name ("bf16", "fp32" ...); fp32 follows `fp32_matmul`."""
        key = self.fp32_matmul if dtype_name == "fp32" else dtype_name
        try:
            return self.device.peak_flops[key]
        except KeyError:
            raise ValueError(f"profile {self.name!r} has no peak for {key!r}; it lists "
                             f"{sorted(self.device.peak_flops)}") from None

    def eff(self, key: str) -> float:
        """The flat efficiency factor `key` (the fallback of the shape tables)."""
        return self.efficiency[key]

    def matmul_eff(self, dtype_name: str, m: float | None = None, n: float | None = None,
                   k: float | None = None) -> float:
        """Fraction of peak[dtype] a GEMM of shape (m, n, k) reaches: the compute table's when it
        has rows for the dtype and the shape is known, else the flat efficiency.matmul."""
        if self.compute is not None and m is not None:
            # an fp32 GEMM runs at the peak (and so the rows) fp32_matmul names: fp32 or tf32
            e = self.compute.matmul_efficiency(self.fp32_matmul if dtype_name == "fp32" else dtype_name, m, n, k)
            if e is not None:
                return e * self.power_ratio
        return self.efficiency["matmul"] * self.power_ratio

    def attention_eff(self, dtype_name: str, seq: float | None = None, head_dim: float | None = None,
                      causal: bool = False, backward: bool = False) -> float:
        """Fraction of peak[dtype] fused attention reaches at (seq, head_dim, causal), forward or
        backward: the compute table's, else the flat efficiency.attention."""
        if self.compute is not None and seq is not None:
            e = self.compute.attention_efficiency(dtype_name, seq, head_dim or 64, causal, backward)
            if e is not None:
                return e * self.power_ratio
        return self.efficiency["attention"] * self.power_ratio

    def contention_for(self, inter_node: bool) -> float:
        """The compute slowdown k (compute runs 1 + k times slower) while a collective on the
        inter-node (True) or intra-node (False) link overlaps it."""
        return float(self.contention.get("inter_node" if inter_node else "intra_node", 0.0))

    def with_contention(self, intra_node: float, inter_node: float | None = None) -> "Hardware":
        """A copy with the contention factors replaced (inter_node defaults to intra_node)."""
        c = {"intra_node": intra_node, "inter_node": intra_node if inter_node is None else inter_node}
        _check_contention(self.name, c)
        return replace(self, contention={k: float(v) for k, v in c.items()},
                       calibration={**self.calibration, "source": "calibrated"})

    def kernel_floor(self, kind: str) -> float:
        """The shortest device time of one kernel of `kind` (0 without a compute table)."""
        return self.compute.floor(kind) if self.compute is not None else 0.0

    def with_compute(self, table: ComputeTable | None) -> "Hardware":
        """A copy with the compute table replaced (what `autopar tune` writes)."""
        return replace(self, compute=table, calibration={**self.calibration, "source": "calibrated"})

    def with_power_ratio(self, ratio: float, duty: float | None = None) -> "Hardware":
        """A copy whose GEMMs and attention run at `ratio` x their burst throughput (sustained
        load at the power limit, at GEMM duty `duty`: `cost.power.sustained`)."""
        if not 0 < ratio <= 1:
            raise ValueError(f"power_ratio must be in (0, 1], got {ratio!r}")
        return replace(self, power_ratio=float(ratio), power_duty=duty)

    def with_nodes(self, nodes: int) -> "Hardware":
        """The same hardware with a different node count (e.g. 64 nodes of 8 = 512 GPUs)."""
        if not isinstance(nodes, int) or nodes < 1:
            raise ValueError(f"nodes must be a positive integer, got {nodes!r}")
        return replace(self, nodes=nodes, name=f"{self.name}@{nodes}x{self.gpus_per_node}")

    def calibrated(self, **efficiency: float) -> "Hardware":
        """A copy with efficiency factors replaced. A flat matmul / attention factor replaces
        the compute table's rows of that kind (a calibration states the factor that rules)."""
        bad = {k: v for k, v in efficiency.items() if k not in EFFICIENCY_KEYS or not 0 < v <= 1}
        if bad:
            raise ValueError(f"efficiency factors must be among {EFFICIENCY_KEYS} and in (0, 1], got {bad}")
        table = self.compute
        for kind in ("matmul", "attention"):
            if kind in efficiency and table is not None:
                table = table.without(kind)
        return replace(self, efficiency={**self.efficiency, **efficiency}, compute=table,
                       calibration={**self.calibration, "source": "calibrated"})

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        return {
            "name": d["name"], "description": d["description"], "device": d["device"],
            "topology": {"gpus_per_node": d["gpus_per_node"], "nodes": d["nodes"],
                         "intra_node": d["intra_node"], "inter_node": d["inter_node"]},
            "efficiency": dict(d["efficiency"]), "fp32_matmul": d["fp32_matmul"],
            "kernel_overhead_s": d["kernel_overhead_s"], "kernels": dict(d["kernels"]),
            "calibration": dict(d["calibration"]),
            "host": {"bandwidth": d["host_bandwidth"], "memory_bandwidth": d["host_memory_bandwidth"],
                     "selective_checkpoint_node_s": d["selective_node_s"],
                     "checkpoint_node_s": d["checkpoint_node_s"]},
            "contention": dict(d["contention"]),
            **({"compute": self.compute.to_dict()} if self.compute is not None else {}),
        }  # fmt: skip

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n")


def profile_names() -> list[str]:
    """Names of the profiles shipped in autopar/cost/profiles/."""
    return sorted(p.stem for p in PROFILE_DIR.glob("*.json"))


def default_profile(device_type: str) -> str:
    """The shipped profile plans are made for when none is named: "cpu-gloo" for a CPU mesh,
    "h100-sxm" for any accelerator."""
    return "cpu-gloo" if device_type == "cpu" else "h100-sxm"


def _merge(base: dict, over: Mapping) -> dict:
    out = dict(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else v
    return out


def _raw(name_or_path: str | Path, seen: tuple[str, ...] = ()) -> dict:
    text = str(name_or_path)
    path = Path(text)
    if text.endswith(".json") or path.exists():
        if not path.exists():
            raise ValueError(f"hardware profile file {text!r} does not exist")
    else:
        path = PROFILE_DIR / f"{text}.json"
        if not path.exists():
            raise ValueError(f"unknown hardware profile {text!r}; known profiles: {', '.join(profile_names())} "
                             "(or pass the path of a profile .json file)")
    if str(path) in seen:
        raise ValueError(f"hardware profile {path} extends itself through {' -> '.join(seen)}")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {path} is not valid JSON: {e}") from None
    parent = d.pop("extends", None)
    if parent is not None:
        own_eff, own_compute = d.get("efficiency", {}), d.get("compute", {})
        d = _merge(_raw(parent, seen + (str(path),)), d)
        for kind in ("matmul", "attention"):  # a flat factor of its own overrides the inherited table
            if kind in own_eff and kind not in own_compute and isinstance(d.get("compute"), dict):
                d["compute"] = {k: v for k, v in d["compute"].items() if k != kind}
    return d


def _check_contention(name: str, c: Mapping[str, Any]) -> None:
    bad = {k: v for k, v in c.items() if k in CONTENTION_KEYS
           and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_CONTENTION)}
    unknown = [k for k in c if k not in CONTENTION_KEYS + ("source", "note")]
    if bad or unknown:
        raise ValueError(f"profile {name!r}: contention needs {CONTENTION_KEYS} as numbers in [0, {MAX_CONTENTION}] "
                         f"(the compute slowdown under concurrent communication: 0.19 = 19 % slower; "
                         f"'source'/'note' may say where it comes from); out of range {bad}, unknown keys {unknown}")


def _contention(d: Mapping[str, Any]) -> dict[str, float]:
    c = d.get("contention") or {}
    if not isinstance(c, Mapping):
        raise ValueError(f"profile {d.get('name', '?')!r}: contention must be an object like "
                         f'{{"intra_node": 0.19, "inter_node": 0.19}}, got {c!r}')
    _check_contention(d.get("name", "?"), c)
    return {k: float(c.get(k, 0.0)) for k in CONTENTION_KEYS}


def from_dict(d: Mapping[str, Any]) -> Hardware:
    """Build and validate a Hardware from a profile dict (as stored in the JSON files)."""
    try:
        dev, topo = d["device"], d["topology"]
        hw = Hardware(
            name=d["name"],
            device=Device(name=dev["name"], kind=dev["kind"], memory_bytes=float(dev["memory_bytes"]),
                          peak_flops={k: float(v) for k, v in dev["peak_flops"].items()},
                          memory_bandwidth=float(dev["memory_bandwidth"]), vector_flops=float(dev["vector_flops"])),
            gpus_per_node=int(topo["gpus_per_node"]), nodes=int(topo["nodes"]),
            intra_node=Link(**topo["intra_node"]), inter_node=Link(**topo["inter_node"]),
            efficiency={k: float(v) for k, v in d["efficiency"].items()},
            kernels=dict(d["kernels"]),
            fp32_matmul=d.get("fp32_matmul", "fp32"),
            kernel_overhead_s=float(d.get("kernel_overhead_s", 0.0)),
            description=d.get("description", ""),
            calibration=dict(d.get("calibration", {})),
            host_bandwidth=float(d.get("host", {}).get("bandwidth", DEFAULT_HOST_BANDWIDTH)),
            host_memory_bandwidth=float(d.get("host", {}).get("memory_bandwidth", DEFAULT_HOST_MEMORY_BANDWIDTH)),
            selective_node_s=float(d.get("host", {}).get("selective_checkpoint_node_s", DEFAULT_SELECTIVE_NODE_S)),
            checkpoint_node_s=float(d.get("host", {}).get("checkpoint_node_s", DEFAULT_CHECKPOINT_NODE_S)),
            compute=table_from_dict(d["compute"], d.get("name", "?")) if d.get("compute") is not None else None,
            contention=_contention(d),
        )  # fmt: skip
    except KeyError as e:
        raise ValueError(f"hardware profile {d.get('name', '?')!r} lacks the key {e}; see "
                         f"{PROFILE_DIR / 'h100-sxm.json'} for a complete profile") from None
    if hw.device.kind not in ("cuda", "cpu"):
        raise ValueError(f"device kind must be 'cuda' or 'cpu', got {hw.device.kind!r}")
    if hw.gpus_per_node < 1 or hw.nodes < 1:
        raise ValueError(f"gpus_per_node and nodes must be >= 1, got {hw.gpus_per_node} and {hw.nodes}")
    missing = [k for k in EFFICIENCY_KEYS if k not in hw.efficiency]
    bad = {k: v for k, v in hw.efficiency.items() if not 0 < v <= 1}
    if missing or bad:
        raise ValueError(f"profile {hw.name!r}: efficiency needs {EFFICIENCY_KEYS} in (0, 1]; "
                         f"missing {missing}, out of range {bad}")
    for k, choices in KERNEL_CHOICES.items():
        if hw.kernels.get(k) not in choices:
            raise ValueError(f"profile {hw.name!r}: kernels[{k!r}] = {hw.kernels.get(k)!r}; choose one of {choices}")
    if hw.fp32_matmul not in hw.device.peak_flops:
        raise ValueError(f"profile {hw.name!r}: fp32_matmul={hw.fp32_matmul!r} has no peak in "
                         f"{sorted(hw.device.peak_flops)}")
    return hw


def load_profile(name_or_path: str | Path | Hardware) -> Hardware:
    """A shipped profile by name ("h100-sxm", "h100-64", "cpu-gloo" ...) or a JSON file by path.
    A `Hardware` is returned as is."""
    if isinstance(name_or_path, Hardware):
        return name_or_path
    return from_dict(_raw(name_or_path))
