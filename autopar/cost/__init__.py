"""autopar's cost model: what a captured graph costs to train, per rank, on given hardware.

  analyze(gm, hardware)            per-node FLOPs (FlopCounterMode convention), bytes, saved
                                   tensors, symbolic in b/s          (graph.py, ops.py, saved.py)
  estimate(gm, plan, hardware)     step time, overlap, memory per rank, per layer (estimate.py;
                                   its result estimate_report.py, per-node time node_time.py,
                                   ZeRO's buckets and units zero_comm.py, expert-parallel
                                   memory expert_memory.py, pipeline stages pipeline_memory.py)
  model_states / liveness          parameter, gradient, optimizer bytes; activation peak, the
                                   loss around the outputs (LossModel, CROSS_ENTROPY) (memory.py)
  bytes_sent / collective_time     collectives per algorithm and mesh axis          (comm.py)
  payload_bytes                    what runtime.collectives.COUNTER records per call (comm.py)
  load_profile(name_or_path)       hardware profiles (profiles/*.json)          (hardware.py)

It reads `node.meta["val"]` and `node.meta["nn_module_stack"]` and writes no node.meta key.
"""
from .comm import COLLECTIVES, axis_links, bytes_sent, collective_time, padded_payload, payload_bytes, total_bytes_sent
from .estimate import estimate
from .estimate_report import CommReport, Estimate, LayerReport
from .graph import GraphCost, NodeCost, ParamInfo, analyze
from .hardware import Hardware, Link, load_profile, profile_names
from .memory import CROSS_ENTROPY, GRAPH_ONLY, LossModel, OptimizerSpec, StateBytes, liveness, model_states, params_of
from .ops import RULES as OP_RULES, OpCost, register as register_op
from .saved import SAVED as SAVED_RULES, New, register as register_saved
from .symbolic import B, S, SymbolMap, evaluate

__all__ = [
    "B", "COLLECTIVES", "CROSS_ENTROPY", "CommReport", "GRAPH_ONLY", "LossModel", "Estimate", "GraphCost", "Hardware", "LayerReport", "Link", "New",
    "NodeCost", "OP_RULES", "OpCost", "OptimizerSpec", "ParamInfo", "S", "SAVED_RULES", "StateBytes",
    "SymbolMap", "analyze", "axis_links", "bytes_sent", "collective_time", "estimate", "evaluate",
    "liveness", "load_profile", "model_states", "padded_payload", "params_of", "payload_bytes", "profile_names",
    "register_op", "register_saved", "total_bytes_sent",
]  # fmt: skip
