"""A small convolutional network with batch normalisation on scikit-learn's bundled digits, as 1x8x8 images.

BatchNorm's running mean and variance (and its batch counter) are buffers the forward pass updates: every backend
carries them through the step and writes them back as eager does, and parity compares them.

    xbridge run programs/cnn.py --backend eager-cpu --steps 100
"""

import torch.nn.functional as F
from torch import nn

import xbridge as xb


class CNN(nn.Module):
    def __init__(self, channels: int = 32, classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, channels, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(channels)
        self.conv2 = nn.Conv2d(channels, 2 * channels, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(2 * channels)
        self.head = nn.Linear(2 * channels * 4 * 4, classes)

    def forward(self, x):
        x = x.view(-1, 1, 8, 8)
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.max_pool2d(F.relu(self.bn2(self.conv2(x))), 2)      # 8x8 -> 4x4
        return self.head(x.flatten(1))


def loss(model, batch):
    return F.cross_entropy(model(batch["x"]), batch["y"])


program = xb.Program(
    name="cnn",
    model=CNN,
    loss=loss,
    data=xb.data.Digits(batch_size=64),
    optimizer=xb.SGD(lr=0.01, momentum=0.9, weight_decay=1e-4),
    precision="fp32",
    mesh=xb.Mesh(data=-1),
    sharding=xb.Sharding(batch=("data",)),
    seed=0,
)
