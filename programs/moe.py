"""A small mixture-of-experts decoder on the Python standard library's source (bytes, no download): each block's
feed-forward is 4 experts, each token routed to its top 2 by a learned router, with the Switch Transformer's
load-balancing loss taken per sequence. The experts' weights are one tensor per projection with the expert first,
so the sharding rule `experts` splits them over an `expert` mesh axis (expert parallelism), e.g.

    xbridge run programs/moe.py --backend eager-cpu --steps 100
    xbridge run programs/moe.py --backend jax-cpu --devices 4 --mesh data=2,expert=2

Dispatch is dense: every expert runs on every token and the router's weights (zero outside each token's top 2)
combine them. Shapes never depend on the routing, so the step compiles once on every backend; the cost is
experts / top_k times the FLOPs of sparse dispatch (tests/fixtures/hf_zoo.py trains transformers' sparse,
sorted-by-expert MoE on every backend too).
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import xbridge as xb


class Experts(nn.Module):
    def __init__(self, experts: int, dim: int, hidden: int) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(experts, dim, hidden) / math.sqrt(dim))
        self.w_out = nn.Parameter(torch.randn(experts, hidden, dim) / math.sqrt(hidden))

    def forward(self, x: torch.Tensor, gates: torch.Tensor) -> torch.Tensor:
        """x: (tokens, dim); gates: (tokens, experts), zero outside each token's chosen experts."""
        h = F.gelu(torch.einsum("td,edh->eth", x, self.w_in))
        return torch.einsum("eth,ehd,te->td", h, self.w_out, gates)


class MoE(nn.Module):
    def __init__(self, dim: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.top_k, self.experts_count = top_k, experts
        self.router = nn.Linear(dim, experts, bias=False)
        self.experts = Experts(experts, dim, 2 * dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        tokens = x.reshape(b * t, d)
        probs = F.softmax(self.router(tokens).float(), dim=-1)
        top, chosen = probs.topk(self.top_k, dim=-1)
        gates = torch.zeros_like(probs).scatter(1, chosen, top / top.sum(dim=-1, keepdim=True))
        # Switch Transformer's load balancing, taken per sequence (DeepSeek-V3's sequence-wise form): experts x
        # sum_e (share of the sequence's tokens routed to e) x (their mean router probability), averaged over the
        # sequences. A mean over examples, so a batch split over data-parallel devices gives the same loss; the
        # batch-wide form (a product of two means over the batch) does not (docs/parity.md)
        routed = F.one_hot(chosen, self.experts_count).float().sum(dim=1).view(b, t, -1).mean(dim=1) / self.top_k
        balance = self.experts_count * (routed * probs.view(b, t, -1).mean(dim=1)).sum(dim=-1).mean()
        return self.experts(tokens, gates.to(x.dtype)).reshape(b, t, d), balance


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, experts: int, top_k: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv = nn.Linear(dim, 3 * dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.moe = MoE(dim, experts, top_k)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        b, t, d = x.shape
        q, k, v = (part.view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for part in self.qkv(self.ln1(x)).chunk(3, dim=-1))
        x = x + self.o(F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d))
        out, balance = self.moe(self.ln2(x))
        return x + out, balance


class MoEDecoder(nn.Module):
    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2, heads: int = 4, experts: int = 4,
                 top_k: int = 2, seq: int = 64) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.randn(seq, dim) * 0.02)
        self.blocks = nn.ModuleList(Block(dim, heads, experts, top_k) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        balance = x.new_zeros((), dtype=torch.float32)
        for block in self.blocks:
            x, b = block(x)
            balance = balance + b
        return self.head(self.ln_f(x)), balance / len(self.blocks)


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    tokens = batch["tokens"]
    logits, balance = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1).float(), tokens[:, 1:].flatten()) + 0.01 * balance


program = xb.Program(
    name="moe",
    model=MoEDecoder,
    loss=loss,
    data=xb.data.ByteText.python_stdlib(seq_len=65, batch_size=16),
    optimizer=xb.AdamW(lr=3e-3, betas=(0.9, 0.95), weight_decay=0.01, schedule=xb.WarmupCosine(10, 200)),
    mesh=xb.Mesh(data=-1, expert=1),
    sharding=xb.Sharding(params={r".*\.experts\.w_(in|out)": ("expert",)}, batch=("data",)),
)
