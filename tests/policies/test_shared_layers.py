"""One layer's weights shared by several blocks, each block calling its own low-rank adapters in it (Zamba2's
shared transformer), and Zamba's multi-head Mamba mixer: what the derived route reads off them (cheap: no
ranks; the conformance sweep proves the Zamba and Zamba2 rows exact on two)."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardformer.core.example_inputs import give_example_inputs
from shardformer.policies.derived import derive
from shardformer.policies.derived.mixers import layout_of
from shardformer.policies.derived.trace import pair, trace

WIDTH, HEADS, RANK = 16, 4, 4


def _adapters(out: int, blocks: int) -> nn.ModuleList:
    return nn.ModuleList(
        nn.Sequential(nn.Linear(WIDTH, RANK, bias=False), nn.Linear(RANK, out, bias=False)) for _ in range(blocks)
    )


class SharedLayer(nn.Module):
    """Attention then a gated MLP, with no residual between (the block adds one around the whole); the
    queries and the MLP's [gate | up] each get the calling block's adapter ``up(down(x))`` added."""

    def __init__(self, blocks: int) -> None:
        super().__init__()
        self.num_heads = HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(WIDTH, WIDTH) for _ in range(4))
        self.q_adapters = _adapters(WIDTH, blocks)
        self.gate_up = nn.Linear(WIDTH, 4 * WIDTH)
        self.gate_up_adapters = _adapters(4 * WIDTH, blocks)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, index: int) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.q(x) + self.q_adapters[index](x)
        q, k, v = (t.view(b, s, self.num_heads, -1).transpose(1, 2) for t in (q, self.k(x), self.v(x)))
        h = self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, s, -1))
        gate, up = (self.gate_up(h) + self.gate_up_adapters[index](h)).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class Block(nn.Module):
    def __init__(self, shared: SharedLayer, index: int) -> None:
        super().__init__()
        self.norm, self.shared, self.index = nn.LayerNorm(WIDTH), shared, index

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.shared(self.norm(x), self.index)


class SharedModel(nn.Module):
    """Two blocks, each holding its own copy of the shared layer with every weight tied to the first's."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        layers = [SharedLayer(2) for _ in range(2)]
        for name, param in layers[0].named_parameters():
            owner, _, leaf = name.rpartition(".")
            layers[1].get_submodule(owner)._parameters[leaf] = param
        self.blocks = nn.ModuleList(Block(layer, i) for i, layer in enumerate(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def test_a_shared_layer_is_judged_by_the_blocks_that_call_it():
    """Each block calls its own adapter: the other block's, never called here, is called there (its tied
    weight read by a module holding it), not read by the code; the adapters' up projections are cut with
    the column beside them ([gate | up] in two blocks, the queries by heads), their down projections whole."""
    model, x = SharedModel(), torch.randn(2, 6, WIDTH)
    flows = trace(model, {"x": x})
    assert flows.bypassed == {"blocks.0": [], "blocks.1": []}
    groups, whole = pair(flows.reads["blocks.1"], after_rows=True)
    assert {(g.cols, g.row) for g in groups} == {
        (("shared.k", "shared.q", "shared.q_adapters.1.1", "shared.v"), "shared.o"),
        (("shared.gate_up", "shared.gate_up_adapters.1.1"), "shared.down"),
    }
    assert set(whole) == {"shared.q_adapters.1.0", "shared.gate_up_adapters.1.0"}
    give_example_inputs(model, {"x": x})
    rule = derive(model, 2).rules[Block]  # each group's cut simulated on the ranks' shares: exact
    assert rule.cols["shared.gate_up"] == rule.cols["shared.gate_up_adapters.0.1"] == 2, rule.cols
    assert rule.cols["shared.q_adapters.1.1"] == 1 and rule.rows == {"shared.o", "shared.down"}, rule
    assert {"shared.q_adapters.0.0", "shared.gate_up_adapters.1.0"} <= rule.whole, rule.whole


def test_zambas_multi_head_mixer_is_cut_by_its_heads():
    """Zamba's mixer scans each of its n_mamba_heads alone (x_proj, dt_proj, A_log, D as [heads, ...]) and
    writes x and the gate channel by channel: the written width is cut evenly, the heads with the ranks."""
    import transformers as tf
    from transformers.models.zamba.modeling_zamba import ZambaMambaMixer

    config = tf.ZambaConfig(
        hidden_size=32, n_mamba_heads=4, mamba_dt_rank=4, num_hidden_layers=1, layers_block_type=["mamba"]
    )
    mixer = ZambaMambaMixer(config, 0)
    layout = layout_of(mixer, mixer.conv1d, mixer.in_proj, mixer.out_proj, 2, interleaved=True)
    assert layout.cuts == {"written": ((128,), None), "inner": ((64,), None), "heads": ((4,), None)}
    assert layout_of(mixer, mixer.conv1d, mixer.in_proj, mixer.out_proj, 8).fix  # 4 heads over 8 ranks: refused
