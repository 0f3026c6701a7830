"""passes/split_pipeline.py on a graph captured with a symbolic sequence: a tensor that depends
on the inputs only through their sizes (a table sliced to the sequence length, as a rotary
table is) is computed on every stage that reads it and never sent between stages, and the
stages compose to the same outputs as the captured graph. (Under context parallelism such a
table is computed at the global length while its meta keeps the local one; sent, it gave the
next stage a wrong sequence length: tests/dist/test_pipeline_context.py trains that.)"""
import torch
import torch.nn as nn

from autopar.capture import capture
from autopar.passes.pass_manager import PassContext
from autopar.passes.plan import Plan
from autopar.passes.split_pipeline import split_pipeline


class TableModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.register_buffer("table", torch.randn(32, 8))

    def forward(self, x):  # (B, T) -> (B, T, 8)
        tab = self.table[: x.shape[1]]  # (T, 8): depends on the input only through its length
        h = self.emb(x) + tab
        for layer in self.layers:
            h = layer(h) + tab
        return h


def test_a_size_only_tensor_is_recomputed_on_each_stage_and_never_sent():
    torch.manual_seed(0)
    model = TableModel()
    x = torch.randint(0, 16, (2, 12))
    gm = capture(model, (x,), dynamic_seq=True)
    pipe = split_pipeline(gm, PassContext(plan=Plan(mesh={"pp": 2}, dp_axis=None, split_points=["layers.1"]), mesh_sizes={"pp": 2}))
    info = pipe.meta["autopar_pipeline"]
    assert info.n_stages == 2
    received = [n for n in pipe.stage1.graph.nodes if n.op == "placeholder"]
    assert len(received) == 1 and received[0].meta["val"].dim() == 3, [n.name for n in received]  # the hidden only
    slices = [n for n in pipe.stage1.graph.nodes if n.op == "call_function" and n.target is torch.ops.aten.slice.Tensor]
    assert slices, "stage 1 does not compute the table itself"
    for t in (12, 20):  # any sequence length: the stages read it from what they receive
        xt = torch.randint(0, 16, (2, t))
        torch.testing.assert_close(pipe(xt)[0], model(xt), rtol=0, atol=0)
