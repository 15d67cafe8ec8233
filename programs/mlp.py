"""A multilayer perceptron classifying scikit-learn's bundled 8x8 digits (no download).

    xbridge run programs/mlp.py --backend eager-cpu --steps 100
"""

import torch.nn.functional as F
from torch import nn

import xbridge as xb


class MLP(nn.Module):
    def __init__(self, inputs: int = 64, hidden: int = 256, classes: int = 10) -> None:
        super().__init__()
        self.fc1 = nn.Linear(inputs, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, classes)

    def forward(self, x):
        x = F.relu(self.fc1(x))
        x = xb.shard(x, "data", "model")
        x = F.relu(self.fc2(x))
        return self.out(x)


def loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


program = xb.Program(
    name="mlp",
    model=MLP,
    loss=loss,
    data=xb.data.Digits(batch_size=64),
    optimizer=xb.SGD(lr=0.05, momentum=0.9, dampening=0.0, weight_decay=1e-4, nesterov=False),
    precision="fp32",
    mesh=xb.Mesh(data=-1, model=1),
    sharding=xb.Sharding(
        params={r"fc1\.(weight|bias)": ("model",),             # column-parallel: hidden units split
                r"fc2\.weight": (None, "model")},               # row-parallel: input features split
        batch=("data",),
    ),
    seed=0,
)
