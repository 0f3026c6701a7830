"""The joint planner's price of offload (masters and optimizer states on the host): what
`search.plan_tables.PlanTables` inherits. The copies between host and device and the CPU's
optimizer step, per step, from the units' states (`UnitStates.offload_elems`, `offload_mo`) at
the plan's precision, by `cost.optimizer_step.offload_step_seconds`: the function
`cost.estimate` prices an offloaded step with."""
from __future__ import annotations

from autopar.cost.optimizer_step import offload_step_seconds
from autopar.passes.plan import torch_dtype


class OffloadTables:
    """Mixin of `PlanTables`: reads its `states`, `gc`, `precision`, `param_dtype`,
    `reduce_dtype` and `hw`."""

    def offload_seconds(self, plan) -> tuple[float, float]:
        """(host<->device copies, CPU step) seconds per step of a planned `plan` (the busiest
        pipeline rank's share taken as 1/pp of the whole)."""
        mesh = plan.mesh
        st = self.states(mesh.get("tp", 1), plan.zero_stage, mesh.get("dp", 1), mesh.get("ep", 1))
        return self._offload_parts(*self._offload_totals(st, mesh.get("pp", 1)), plan.zero_stage)

    def _offload_totals(self, st, div: float = 1.0) -> tuple[float, float]:
        """(elements the CPU steps, master + optimizer bytes on the host) over every unit, / div."""
        if st.offload_elems is None:
            return 0.0, 0.0
        return float(st.offload_elems.sum()) / div, float(st.offload_mo.sum()) / div

    def _offload_parts(self, elems: float, host_mo: float, zero_stage: int) -> tuple[float, float]:
        """(host<->device copies, CPU step) seconds of an offloaded step over `elems` elements."""
        trained = [p for p in self.gc.params if p.requires_grad and not p.is_buffer]
        p_item = max(((self.param_dtype or p.dtype).itemsize for p in trained), default=4)
        g_item = self.reduce_dtype.itemsize if self.reduce_dtype is not None else p_item
        master = torch_dtype(self.precision.get("master_dtype"))
        m_item = master.itemsize if master is not None else max((p.dtype.itemsize for p in trained), default=4)
        return offload_step_seconds(elems, host_mo, g_item, m_item, self.hw.host_bandwidth,
                                    self.hw.host_memory_bandwidth, zero_stage=zero_stage)
