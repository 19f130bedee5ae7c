"""The tensor / expert parallel transform: one rank's shard of `Qwen35Model`.

`ParallelModel(config, plan, comm)` is `Qwen35Model` built from `plan.rank_config(config)`
(heads and widths / N, so every projection already has its per-rank shape), with the
layers whose output needs the other ranks swapped for their parallel twins:

- `RowParallelLinear` for attention `o_proj`, DeltaNet `out_proj` and the dense FFN's
  `down_proj`: the partial products [T, D] are summed over ranks (then the bias added once);
- `ParallelMoE` for the MoE FFN: the router runs replicated; with expert parallel each rank
  runs only the (token, choice) pairs routed to its experts and the routed + shared-expert
  partial outputs are summed over ranks in one all-reduce (activations are replicated
  under TP, so dispatch is a local selection and combine an all-reduce, i.e. reduce-scatter
  + all-gather);
- `VocabParallelEmbedding`: a rank looks up its vocab rows, zeros elsewhere, summed over ranks;
- `logits`: each rank's vocab slice [n, V/N], all-gathered to [n, V] (the tied head uses the
  embedding's slice).

Parameter names stay the checkpoint's, so the loader fills them with `plan.shard` slices.
The vision tower is replicated. With `SingleProcess` and tp=1 this is the plain model.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from vlbatch.operators.model.attention import FullAttention
from vlbatch.operators.model.config import ModelConfig, TextConfig
from vlbatch.operators.model.deltanet import GatedDeltaNet
from vlbatch.operators.model.layers import SwiGLU
from vlbatch.operators.model.model import Qwen35Model
from vlbatch.operators.model.moe import Experts, SparseMoE
from vlbatch.operators.parallel.comm import Comm
from vlbatch.operators.parallel.plan import ParallelPlan


class RowParallelLinear(nn.Linear):
    """y = sum_ranks(x_r W_r^T) + b: x [T, in/N] (this rank's input columns) -> [T, out]."""

    def __init__(self, linear: nn.Linear, comm: Comm):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None,
                         device=linear.weight.device, dtype=linear.weight.dtype)
        self.comm = comm

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.comm.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Embedding):
    """ids [...] -> [..., D]; this rank holds rows [start, start + V/N) of the table."""

    def __init__(self, num_local: int, dim: int, start: int, comm: Comm):
        super().__init__(num_local, dim, _weight=torch.empty(num_local, dim))
        self.start, self.comm = start, comm

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_embeddings)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        return self.comm.all_reduce(out.masked_fill(outside[..., None], 0.0))


class ParallelMoE(SparseMoE):
    """`SparseMoE` on one rank: [T, D] -> [T, D] (summed over ranks). With expert parallel,
    `experts` holds experts [e0, e1) only; without, every expert's inner width / N."""

    def __init__(self, cfg: TextConfig, experts: tuple[int, int], expert_parallel: bool, comm: Comm):
        super().__init__(cfg)
        self.e0, self.e1 = experts
        self.expert_parallel, self.comm = expert_parallel, comm
        if expert_parallel:
            self.experts = Experts(self.e1 - self.e0, cfg.hidden_size, cfg.moe_intermediate_size, cfg.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # routing (`SparseMoE.route`) is replicated; routed + shared expert are this rank's partials
        return self.comm.all_reduce(super().forward(x))

    def routed(self, x: torch.Tensor, top_i: torch.Tensor, top_w: torch.Tensor) -> torch.Tensor:
        """Without expert parallel: every expert, partial over the inner width. With it: the
        choices routed to experts [e0, e1), one (token, choice) pair per row -> [T, D]."""
        if not self.expert_parallel:
            return super().routed(x, top_i, top_w)
        tok, choice = ((top_i >= self.e0) & (top_i < self.e1)).nonzero(as_tuple=True)  # [P]
        out = torch.zeros_like(x)
        if tok.numel():
            index = (top_i[tok, choice] - self.e0)[:, None]  # [P, 1]
            y = self.experts(x[tok], index, top_w[tok, choice][:, None])  # [P, D]
            out.index_add_(0, tok, y)
        return out


class ParallelModel(Qwen35Model):
    """Rank `plan.rank` of a `plan.tp`-way sharded `Qwen35Model`; `config` is the rank's
    config (caches built from it get per-rank shapes), `full_config` the checkpoint's."""

    def __init__(self, config: ModelConfig, plan: ParallelPlan, comm: Comm):
        super().__init__(plan.rank_config(config))
        self.full_config, self.plan, self.comm = config, plan, comm
        text = self.config.text
        lm = self.language_model
        vocab = text.vocab_size // plan.tp  # rows [rank * vocab, (rank + 1) * vocab)
        lm.embed_tokens = VocabParallelEmbedding(vocab, text.hidden_size, plan.rank * vocab, comm)
        if self.lm_head is not None:
            self.lm_head = nn.Linear(text.hidden_size, vocab, bias=False)
        for layer in lm.layers:
            mixer = layer.linear_attn if layer.is_linear else layer.self_attn
            if isinstance(mixer, GatedDeltaNet):
                mixer.out_proj = RowParallelLinear(mixer.out_proj, comm)
            elif isinstance(mixer, FullAttention):
                mixer.o_proj = RowParallelLinear(mixer.o_proj, comm)
            if isinstance(layer.mlp, SparseMoE):
                layer.mlp = ParallelMoE(text, plan.expert_range(config.text), plan.expert_parallel, comm)
            elif isinstance(layer.mlp, SwiGLU):
                layer.mlp.down_proj = RowParallelLinear(layer.mlp.down_proj, comm)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Final norm + this rank's vocab slice, gathered: [n, D] -> [n, V]."""
        return self.comm.all_gather(super().logits(hidden), dim=-1)


@dataclass(frozen=True)
class RankShard:
    """One rank's layout for `load_model(layout=...)`: its `ParallelModel`, and `plan.shard`'s
    slice of each checkpoint tensor (so a rank reads only its slices)."""

    plan: ParallelPlan
    comm: Comm

    def build(self, config: ModelConfig) -> ParallelModel:
        return ParallelModel(config, self.plan, self.comm)

    def slice(self, name: str, shape: tuple[int, ...], text: TextConfig):
        return self.plan.shard(name, shape, text)
