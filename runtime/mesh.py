"""The device mesh: named axes over the ranks of a job.

A `Mesh` is first a shape (`{"dp": 2, "tp": 2}`), usable for planning without any process
(64 or 16k ranks on one laptop). When the job is running (`torch.distributed` initialised),
`Mesh.device_mesh` builds PyTorch's `DeviceMesh` over it, and `group(axis)` returns the
process group of this rank along an axis. Rank layout is row-major over the axes in order:
the last axis varies fastest (put `tp` last so that it stays inside a node). A joined axis
name, "dp+cp", stands for the ranks that differ only along its parts (size, index, ranks and
group as one axis): context-parallel ranks hold the same parameters as data-parallel ones, so
gradients and ZeRO shards live on "dp+cp".

Guarantees: the product of the axis sizes equals the world size whenever a process group
exists; axis names are unique; errors name the sizes and say how to fix them; the axis groups
time out as the job's default group does (torch's `new_group` would wait 30 minutes), or after
$AUTOPAR_COLLECTIVE_TIMEOUT_S / 60 s when the job runs with torch's untouched default
(`timeouts.group_timeout`).

Device: a mesh's device follows the running job's backend (`default_device_type`): NCCL means
CUDA, a gloo world means the CPU even on a machine with a GPU (a forked test world must never
touch CUDA). Collectives on the mesh's groups take tensors of the mesh's device only (NCCL
rejects CPU tensors); host-side values (step times, flags, plain objects) travel over
`host_group()`, a gloo group of the whole job.
"""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass, field
from typing import Mapping

import torch
import torch.distributed as dist

from ._torch_compat import pytree
from .timeouts import group_timeout

# Canonical order when sizes are given as keywords: pipeline outermost, tensor innermost.
AXIS_ORDER = ("pp", "dp", "ep", "cp", "tp")


@dataclass
class Mesh:
    sizes: dict[str, int]
    device_type: str = "cpu"
    _device_mesh: object = field(default=None, repr=False, compare=False)
    _joined: dict = field(default_factory=dict, repr=False, compare=False)  # "dp+cp" -> this rank's group

    def __post_init__(self):
        if not self.sizes:
            raise ValueError("a mesh needs at least one axis, e.g. autopar.mesh(dp=4)")
        for a, s in self.sizes.items():
            if not isinstance(s, int) or s < 1:
                raise ValueError(f"mesh axis {a!r} has size {s!r}; sizes must be positive integers")

    # --- shape -------------------------------------------------------------------------
    @property
    def axis_names(self) -> tuple[str, ...]:
        return tuple(self.sizes)

    @property
    def world_size(self) -> int:
        n = 1
        for s in self.sizes.values():
            n *= s
        return n

    def size(self, axis: str) -> int:
        """The axis' size: 1 for an absent axis; the product of its parts for a joined axis."""
        if "+" in axis:
            n = 1
            for part in self.parts(axis):
                n *= self.size(part)
            return n
        if axis not in self.sizes:
            return 1
        return self.sizes[axis]

    def has_axis(self, axis: str) -> bool:
        """Whether `axis` names an axis of this mesh, or joins some of them ("dp+cp")."""
        if "+" in axis:
            try:
                self.parts(axis)
            except ValueError:
                return False
            return True
        return axis in self.sizes

    def parts(self, axis: str) -> tuple[str, ...]:
        """The axes a joined axis name stands for: "dp+cp" -> ("dp", "cp"), the ranks that
        differ only in dp and cp (gradients of parameters replicated over both are averaged
        over them). A joined name lists axes of this mesh in mesh order."""
        names = tuple(axis.split("+"))
        order = [a for a in self.axis_names if a in names]
        if len(set(names)) != len(names) or tuple(order) != names:
            raise ValueError(f"joined axis {axis!r} must list distinct axes of {self} in mesh order "
                             f"({'+'.join(order) or 'none of them exist'})")
        return names

    def index(self, axis: str, rank: int) -> int:
        """`rank`'s index along `axis` (row-major over a joined axis' parts; 0 when absent)."""
        c = self.coords(rank)
        if "+" not in axis:
            return c.get(axis, 0)
        i = 0
        for part in self.parts(axis):
            i = i * self.sizes[part] + c[part]
        return i

    def coords(self, rank: int) -> dict[str, int]:
        """This rank's index along every axis (row-major, last axis fastest)."""
        out: dict[str, int] = {}
        rest = rank
        for a in reversed(self.axis_names):
            out[a] = rest % self.sizes[a]
            rest //= self.sizes[a]
        return dict(reversed(list(out.items())))

    def rank_of(self, coords: Mapping[str, int]) -> int:
        r = 0
        for a in self.axis_names:
            r = r * self.sizes[a] + coords.get(a, 0)
        return r

    def axis_ranks(self, axis: str, rank: int) -> list[int]:
        """The global ranks in `rank`'s group along `axis`, in axis order."""
        c = self.coords(rank)
        if "+" in axis:
            out = [c]
            for part in self.parts(axis):
                out = [{**o, part: i} for o in out for i in range(self.sizes[part])]
            return [self.rank_of(o) for o in out]
        return [self.rank_of({**c, axis: i}) for i in range(self.sizes[axis])]

    def __str__(self) -> str:
        return "Mesh(" + ", ".join(f"{a}={s}" for a, s in self.sizes.items()) + ")"

    # --- live job ----------------------------------------------------------------------
    @property
    def device_mesh(self):
        """PyTorch's DeviceMesh over this shape (built once, needs torch.distributed)."""
        if self._device_mesh is None:
            if not dist.is_initialized():
                raise RuntimeError(f"{self} has no process group: start the job with torchrun "
                                   "(or autopar's launcher) before running on it")
            ws = dist.get_world_size()
            if ws != self.world_size:
                raise ValueError(f"{self} has {self.world_size} ranks but the job has world size {ws}; "
                                 f"choose axis sizes whose product is {ws}")
            # the axis groups time out as the job does (runtime/timeouts.py), not after torch's
            # 30 minutes for new groups
            self._device_mesh = device_mesh_with_timeout(self.sizes, group_timeout(self.device_type),
                                                         self.device_type)
        return self._device_mesh

    def group(self, axis: str):
        """This rank's process group along `axis`."""
        if "+" in axis:
            return self._joined_group(axis)
        if axis not in self.sizes:
            raise ValueError(f"{self} has no axis {axis!r}; its axes are {list(self.axis_names)}")
        return self.device_mesh.get_group(axis)

    def _joined_group(self, axis: str):
        # made once per joined axis, collectively (every rank makes every group, in order);
        # the program asks for it while it is built, at the same point on every rank
        made = self._joined.get(axis)
        if made is None:
            self.device_mesh  # noqa: B018 - the axis groups first, in the same order everywhere
            lines = sorted({tuple(self.axis_ranks(axis, r)) for r in range(self.world_size)})
            me, made = dist.get_rank(), None
            for ranks in lines:
                g = dist.new_group(list(ranks), timeout=group_timeout(self.device_type),
                                   backend="gloo" if self.device_type == "cpu" else None)
                if me in ranks:
                    made = g
            self._joined[axis] = made
        return made

    def local_rank(self, axis: str) -> int:
        """This rank's index along `axis` (0 when the axis is absent)."""
        if axis not in self.sizes and "+" not in axis:
            return 0
        return self.index(axis, dist.get_rank())

    @property
    def device(self) -> torch.device:
        if self.device_type == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device(self.device_type)

    def to_device(self, tree):
        """`tree` with every tensor on another real device moved to this mesh's device (as DDP
        and FSDP move their inputs): a CPU batch reaches a GPU program. Meta tensors stay (the
        step refuses them with its own message)."""
        dev = self.device
        return pytree.tree_map(
            lambda t: t.to(dev, non_blocking=dev.type == "cuda") if isinstance(t, torch.Tensor) and t.device != dev
            and t.device.type != "meta" else t, tree)


def default_device_type() -> str:
    """The device type a job's tensors live on: "cuda" when the default process group runs
    NCCL, "cpu" when it runs gloo only (even where a GPU is visible: a gloo world forked from a
    process that initialised CUDA cannot use it); without a process group, "cuda" when a GPU is
    visible (planning)."""
    if dist.is_initialized():
        backend = str(dist.get_backend()).lower()
        return "cuda" if ("nccl" in backend or "cuda:" in backend) else "cpu"
    return "cuda" if torch.cuda.is_available() else "cpu"


# --- host-side groups ------------------------------------------------------------------------
_HOST_GROUPS: dict[str, tuple[object, object]] = {}  # name -> (the WORLD it was made in, group)
_HOST_GROUP_IDS: dict[int, object] = {}  # id -> group, for is_host_group (kept alive here)


def host_group(name: str = "host", timeout_s: float | None = None):
    """A gloo group of the whole job for host-side values: step times, flags, plain objects.
    One per `name` and job, made on first use (collective then: every rank asks for the same
    names in the same order); None without a process group. Under NCCL the default group and
    the mesh's groups reject CPU tensors, and sending a host value through device memory would
    cost a copy and a synchronisation besides; give a part of the program its own name when it
    may run beside the training's own host collectives (checkpoints on a background thread)."""
    if not dist.is_initialized():
        return None
    world = dist.group.WORLD
    made = _HOST_GROUPS.get(name)
    if made is None or made[0] is not world:
        kw = {"timeout": datetime.timedelta(seconds=timeout_s)} if timeout_s else {}
        made = (world, mark_host_group(dist.new_group(backend="gloo", **kw)))
        _HOST_GROUPS[name] = made
    return made[1]


def planning_group():
    """The host group on which rank 0's planning answers (sharding search, joint plan, pipeline
    split) reach the other ranks. While rank 0 plans they wait, for as long as planning takes:
    its timeout is `AUTOPAR_PLANNING_TIMEOUT_S` (default 1800 s), not the collectives' short one."""
    import os  # noqa: PLC0415

    raw = os.environ.get("AUTOPAR_PLANNING_TIMEOUT_S", "1800")
    try:
        timeout_s = float(raw)
    except ValueError:
        raise ValueError(f"AUTOPAR_PLANNING_TIMEOUT_S={raw!r} is not a number of seconds") from None
    if timeout_s <= 0:
        raise ValueError(f"AUTOPAR_PLANNING_TIMEOUT_S={raw!r} must be a positive number of seconds")
    return host_group("planning", timeout_s=timeout_s)


def mark_host_group(group):
    """Declare `group` (a gloo group) a host-side group: collectives on it take CPU tensors.
    Returns it. Device checks (tests/dist/test_device_guard.py) treat every other group as
    running on the mesh's device."""
    _HOST_GROUP_IDS[id(group)] = group
    return group


def is_host_group(group) -> bool:
    """Whether `group` was made by `host_group` or declared by `mark_host_group`."""
    return group is not None and _HOST_GROUP_IDS.get(id(group)) is group


def device_mesh_with_timeout(sizes: Mapping[str, int], timeout: datetime.timedelta, device_type: str = "cpu"):
    """A DeviceMesh over the running job (row-major over `sizes`) whose process groups time out
    after `timeout` (collective: every rank calls it, in the same order)."""
    from torch.distributed.device_mesh import DeviceMesh

    names = tuple(sizes)
    grid = torch.arange(dist.get_world_size()).reshape(tuple(sizes.values()))
    me, groups = dist.get_rank(), []
    for d in range(len(names)):
        lines = grid.movedim(d, -1).reshape(-1, grid.shape[d]).tolist()
        mine = None
        for ranks in lines:  # new_group is collective: every rank creates every group, in order
            g = dist.new_group(ranks, timeout=timeout, backend="gloo" if device_type == "cpu" else None)
            if me in ranks:
                mine = g
        groups.append(mine)
    return DeviceMesh.from_group(groups, device_type, mesh=grid, mesh_dim_names=names)


def make_mesh(world_size: int | None = None, *, device_mesh=None, device_type: str | None = None,
              **axes: int) -> Mesh:
    """Build a Mesh from axis sizes, a world size, a DeviceMesh, or torchrun's environment.

    `make_mesh(dp=2, tp=2)`; `make_mesh(world_size=64)` (all data parallel until a planner
    factorises it); `make_mesh(device_mesh=dm)`; `make_mesh()` inside a torchrun job.
    """
    if device_type is None:
        device_type = default_device_type()
    if device_mesh is not None:
        if axes or world_size is not None:
            raise ValueError("pass either a DeviceMesh or axis sizes, not both")
        names = device_mesh.mesh_dim_names
        if names is None:
            raise ValueError("the DeviceMesh has no mesh_dim_names; build it with "
                             "init_device_mesh(..., mesh_dim_names=('dp', 'tp'))")
        m = Mesh(dict(zip(names, device_mesh.mesh.shape)), device_type=device_mesh.device_type)
        m._device_mesh = device_mesh
        return m
    unknown = [a for a in axes if a not in AXIS_ORDER]
    if unknown:
        raise ValueError(f"unknown mesh axes {unknown}; use {list(AXIS_ORDER)}")
    sizes = {a: axes[a] for a in AXIS_ORDER if a in axes and axes[a] is not None}
    if world_size is None:
        if dist.is_initialized():
            world_size = dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
    if not sizes:
        if world_size is None:
            raise ValueError("give the mesh a size: autopar.mesh(world_size=8), autopar.mesh(dp=2, tp=4), "
                             "or run under torchrun")
        sizes = {"dp": world_size}
    prod = 1
    for s in sizes.values():
        prod *= s
    if world_size is not None and prod != world_size:
        desc = " x ".join(f"{a}={s}" for a, s in sizes.items())
        raise ValueError(f"mesh {desc} has {prod} ranks but the world size is {world_size}; "
                         f"choose axis sizes whose product is {world_size}")
    return Mesh(sizes, device_type=device_type)
