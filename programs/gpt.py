"""A small byte-level GPT trained on the source of Python's own standard library (no network, no download).

    xbridge run programs/gpt.py --backend eager-cpu --steps 100
"""

import math

import torch
import torch.nn.functional as F
from torch import nn

import xbridge as xb


class Block(nn.Module):
    def __init__(self, dim: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = dropout
        self.ln1 = nn.LayerNorm(dim)
        self.q = nn.Linear(dim, dim, bias=False)
        self.k = nn.Linear(dim, dim, bias=False)
        self.v = nn.Linear(dim, dim, bias=False)
        self.o = nn.Linear(dim, dim, bias=False)
        self.ln2 = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim, bias=False)
        self.down = nn.Linear(4 * dim, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        h = self.ln1(x)
        q, k, v = (proj(h).view(b, t, self.heads, d // self.heads).transpose(1, 2)
                   for proj in (self.q, self.k, self.v))
        p = self.dropout if self.training else 0.0
        attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, dropout_p=p)
        if p:   # GPT-2's residual dropout (gpt_dropout)
            x = x + F.dropout(self.o(attn.transpose(1, 2).reshape(b, t, d)), p)
            x = x + F.dropout(self.down(F.gelu(self.up(self.ln2(x)))), p)
        else:
            x = x + self.o(attn.transpose(1, 2).reshape(b, t, d))
            x = x + self.down(F.gelu(self.up(self.ln2(x))))
        return xb.shard(x, "data", None, None)


class GPT(nn.Module):
    def __init__(self, vocab: int, dim: int, layers: int, heads: int, seq: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.pos = nn.Parameter(torch.zeros(seq, dim))
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln_f = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)
        nn.init.normal_(self.pos, std=0.02)
        for name, p in self.named_parameters():
            if name.endswith(("o.weight", "down.weight")):  # GPT-2's scaled init of residual projections
                nn.init.normal_(p, std=0.02 / math.sqrt(2 * layers))

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        x = xb.shard(x, "data", None, None)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))


def loss(model: nn.Module, batch: dict) -> torch.Tensor:
    tokens = batch["tokens"]
    logits = model(tokens[:, :-1])
    return F.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())


def gpt_program(name: str, dim: int, layers: int, heads: int, seq: int, batch: int, lr: float,
                dropout: float = 0.0) -> xb.Program:
    return xb.Program(
        name=name,
        model=lambda: GPT(vocab=256, dim=dim, layers=layers, heads=heads, seq=seq, dropout=dropout),
        loss=loss,
        data=xb.data.ByteText.python_stdlib(seq_len=seq + 1, batch_size=batch),
        optimizer=xb.AdamW(lr=lr, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, schedule=xb.WarmupCosine(20, 1000)),
        precision="fp32",
        mesh=xb.Mesh(data=-1, model=1),
        sharding=xb.Sharding(
            params={r".*\.(q|k|v|up)\.weight": ("model", None),      # column-parallel: output features split
                    r".*\.(o|down)\.weight": (None, "model")},       # row-parallel: input features split
            batch=("data",),
        ),
        step=xb.StepOptions(grad_accum=1, clip_grad_norm=1.0),
        seed=0,
    )


program = gpt_program("gpt", dim=256, layers=4, heads=4, seq=256, batch=16, lr=3e-3)

# GPT-2-small class (12 layers of 768, 1024 tokens; 85 M parameters with the byte vocabulary), sized for one
# accelerator: `xbridge compare programs/gpt.py:gpt2_small --precision bf16-mixed` (bench/accelerator.sh).
gpt2_small = gpt_program("gpt2-small", dim=768, layers=12, heads=12, seq=1024, batch=32, lr=6e-4)

# The GPT with GPT-2's dropout (0.1 on attention weights and both residual branches): what portable randomness
# costs (bench/rng.py); its parity needs --rng portable.
gpt_dropout = gpt_program("gpt-dropout", dim=256, layers=4, heads=4, seq=256, batch=16, lr=3e-3, dropout=0.1)

# Long sequences, for activation memory (bench/remat.py: `xbridge compare programs/gpt.py:gpt_seq1024 --remat full`):
# 6 layers of 256 over 1024 tokens, batch 8.
gpt_seq1024 = gpt_program("gpt-seq1024", dim=256, layers=6, heads=4, seq=1024, batch=8, lr=3e-3)
