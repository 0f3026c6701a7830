"""Every sharding rule, every strategy it offers, run for real on gloo (tp=2): the shard pass
rewrites a one-op graph to that strategy (inputs converted from replicated, the output
converted back), and the forward output and the input gradients equal the single-process op.

Tolerances: fp32; a strategy changes the order of sums (partial results all-reduced), so
outputs and gradients agree to 1e-5 relative / 1e-5 absolute (measured worst case ~1e-6)."""
import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

import autopar
from autopar.passes import ir
from autopar.passes.pass_manager import PassContext
from autopar.passes.plan import Plan
from autopar.passes.rules.sharding import RULES, Strategy, op_name, strategies_for
from autopar.passes.shard import shard
from autopar.runtime import collectives as C
from autopar.runtime.mesh import make_mesh
from harness import world

RTOL = ATOL = 1e-5


class _Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


def _r(*shape):
    return torch.randn(*shape, generator=_G)


_G = torch.Generator().manual_seed(0)
_ids = torch.randint(0, 12, (4, 6), generator=_G)
CASES = [
    ("linear", lambda x, w: F.linear(x, w), (_r(4, 6, 8), _r(10, 8))),
    ("linear_bias", lambda x, w, b: F.linear(x, w, b), (_r(4, 6, 8), _r(10, 8), _r(10))),
    ("mm", torch.mm, (_r(6, 8), _r(8, 4))),
    ("bmm", torch.bmm, (_r(2, 6, 8), _r(2, 8, 4))),
    ("matmul_4d", torch.matmul, (_r(2, 4, 6, 8), _r(2, 4, 8, 6))),
    ("matmul_3d_2d", torch.matmul, (_r(4, 6, 8), _r(8, 10))),
    ("addmm", torch.addmm, (_r(4), _r(6, 8), _r(8, 4))),
    ("add_broadcast", lambda x, y: x + y, (_r(4, 6, 8), _r(6, 8))),
    ("sub", lambda x, y: x - y, (_r(4, 6), _r(4, 6))),
    ("mul", lambda x, y: x * y, (_r(4, 6, 8), _r(8))),
    ("div", lambda x, y: x / y, (_r(4, 6), _r(4, 6).abs() + 1)),
    ("mul_scalar", lambda x: x * 3.0, (_r(4, 6),)),
    ("neg_to", lambda x: (-x).to(torch.float64), (_r(4, 6),)),
    ("silu", F.silu, (_r(4, 6),)),
    ("gelu", F.gelu, (_r(4, 6),)),
    ("where", lambda c, x, y: torch.where(c > 0, x, y), (_r(4, 6), _r(4, 6), _r(4, 6))),
    ("zeros_like", lambda x: torch.zeros_like(x) + x, (_r(4, 6),)),
    ("new_zeros", lambda x: x.new_zeros(4, 6) + x, (_r(4, 6),)),
    ("full", lambda x: torch.full((4, 6), 2.0) * x, (_r(4, 6),)),
    ("arange", lambda x: torch.arange(6, dtype=torch.float32) + x, (_r(4, 6),)),
    ("view_split", lambda x: x.view(4, 6, 2, 4), (_r(4, 6, 8),)),
    ("reshape_merge", lambda x: x.reshape(4, 48), (_r(4, 6, 8),)),
    ("transpose", lambda x: x.transpose(1, 2), (_r(4, 6, 8),)),
    ("permute", lambda x: x.permute(2, 0, 1), (_r(4, 6, 8),)),
    ("unsqueeze_expand", lambda x: x.unsqueeze(1).expand(4, 2, 6), (_r(4, 6),)),
    ("slice", lambda x: x[:, 2:6], (_r(4, 8, 6),)),
    ("select", lambda x: x[:, 1], (_r(4, 8, 6),)),
    ("chunk", lambda x: x.chunk(2, -1)[1] * 2, (_r(4, 6, 8),)),
    ("unbind", lambda x: x.unbind(1)[1] * 2, (_r(4, 3, 8),)),
    ("cat", lambda x, y: torch.cat([x, y], 1), (_r(4, 6, 8), _r(4, 2, 8))),
    ("stack", lambda x, y: torch.stack([x, y], 1), (_r(4, 6), _r(4, 6))),
    ("repeat", lambda x: x.repeat(1, 2), (_r(4, 6),)),
    ("sum_dim", lambda x: x.sum(1), (_r(4, 6, 8),)),
    ("mean_dim", lambda x: x.mean(-1, keepdim=True), (_r(4, 6, 8),)),
    ("sum_all", lambda x: x.sum(), (_r(4, 6),)),
    ("amax", lambda x: x.amax(1), (_r(4, 6, 8),)),
    ("softmax", lambda x: x.softmax(-1), (_r(4, 6, 8),)),
    ("log_softmax", lambda x: F.log_softmax(x, 1), (_r(4, 6, 8),)),
    ("cumsum", lambda x: x.cumsum(1), (_r(4, 6, 8),)),
    ("topk", lambda x: x.topk(2, dim=-1).values, (_r(4, 6, 8),)),
    ("tril", lambda x: x.tril(), (_r(2, 4, 4),)),
    ("rms_norm", lambda x, w: F.rms_norm(x, (8,), w), (_r(4, 6, 8), _r(8))),
    ("layer_norm", lambda x, w, b: F.layer_norm(x, (8,), w, b), (_r(4, 6, 8), _r(8), _r(8))),
    ("sdpa_causal", lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True),
     (_r(2, 4, 6, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8))),
    ("sdpa_mask", lambda q, k, v, m: F.scaled_dot_product_attention(q, k, v, attn_mask=m),
     (_r(2, 4, 6, 8), _r(2, 4, 6, 8), _r(2, 4, 6, 8), _r(6, 6))),
    ("embedding", lambda w, i: F.embedding(i, w), (_r(12, 8), _ids)),
    ("embedding_pad", lambda w, i: F.embedding(i, w, padding_idx=3), (_r(12, 8), _ids)),
    ("index_select", lambda x, i: x.index_select(1, i), (_r(4, 6, 8), torch.tensor([0, 2, 5]))),
    ("gather", lambda x, i: x.gather(2, i), (_r(4, 6, 8), torch.randint(0, 8, (4, 6, 3), generator=_G))),
    ("index_add", lambda x, i, s: x.index_add(0, i, s), (_r(6, 8), torch.tensor([0, 2, 5, 2]), _r(4, 8))),
    ("to_dtype", lambda x: x.to(torch.float32) * 2, (_r(4, 6).double(),)),
]
class _BatchView(nn.Module):
    def forward(self, x):
        return x.view(x.shape[0], 2, 4) * 2


DYNAMIC = {"sym_size": (_BatchView(), (_r(4, 8),))}


def _capture(fn, args, dynamic):
    return autopar.capture(_Op(fn), args, dynamic_batch=dynamic)


def _graphs():
    out = []
    for name, fn, args in CASES:
        out.append((name, _capture(fn, args, False), args))
    for name, (mod, args) in DYNAMIC.items():
        out.append((name, autopar.capture(mod, args, dynamic_batch=True), args))
    return out


def _targets(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and op_name(n.target) in RULES
            and op_name(n.target) != "operator.getitem"]


def _run(gm, args):
    ins = [a.clone().requires_grad_(a.is_floating_point()) for a in args]
    out = gm(*ins)
    out = out[0] if isinstance(out, (tuple, list)) else out
    w = torch.linspace(-1, 1, out.numel(), dtype=out.dtype).view(out.shape) if out.is_floating_point() else None
    if w is not None and out.requires_grad:
        (out * w).sum().backward()
    return out.detach(), [a.grad for a in ins]


def _sweep(rank, ws):
    graphs = _graphs()  # captured on each rank: a pickled GraphModule (fork-server worlds) loses node.meta
    mesh = make_mesh(tp=ws)
    C.set_active_mesh(mesh)
    done, failures, rules_seen = 0, [], set()
    for name, gm, args in graphs:
        ref_out, ref_grads = _run(copy.deepcopy(gm), args)
        keys = ir.node_keys(gm)
        for node in _targets(gm):
            rules_seen.add(RULES[op_name(node.target)].__name__)
            for s in strategies_for(node, "tp", ws).strategies:
                table = {keys[node]: str(s)}
                for u in node.users:  # elements of a tuple keep the tuple's placement
                    if op_name(u.target) == "operator.getitem":
                        rules_seen.add(RULES["operator.getitem"].__name__)
                        table[keys[u]] = str(Strategy((s.out,), s.out, 0.0))
                g2 = copy.deepcopy(gm)
                plan = Plan(mesh={"tp": ws}, dp_axis=None, strategies={"tp": table})
                shard(g2, PassContext(plan=plan, mesh_sizes={"tp": ws}, coords=mesh.coords(rank),
                                      options={"inputs_require_grad": True}))
                g2.recompile()
                try:
                    out, grads = _run(g2, args)
                    torch.testing.assert_close(out, ref_out, rtol=RTOL, atol=ATOL)
                    for g, rg in zip(grads, ref_grads):
                        if rg is not None:
                            torch.testing.assert_close(g, rg, rtol=RTOL, atol=ATOL)
                except AssertionError as e:
                    failures.append(f"{name} {node.name} {s}: {' '.join(str(e).splitlines()[:4])}")
                done += 1
    return done, failures, rules_seen


def test_every_rule_strategy_matches_one_process_on_gloo():
    results = world(2, _sweep)
    done, failures, seen = results[0]
    assert not failures, "\n".join(failures)
    assert done > 150  # every strategy of every case ran
    rule_fns = {fn.__name__ for fn in RULES.values()}
    # rules not reachable from a one-op graph: none
    missing = rule_fns - seen - {"_no_output"}
    assert not missing, f"rules without a sweep case: {sorted(missing)}"
