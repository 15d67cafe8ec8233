"""The optimizer's state created before the first step (xbridge/torch/optimizer_state.py, so that torch_xla traces
step 0 as the graph of every later step) trains exactly as torch.optim's lazy state does."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from xbridge.torch.optimizer_state import create_state  # noqa: E402


def _train(make, created: bool) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
    optimizer = make(model.parameters())
    if created:
        assert create_state(optimizer)
        assert all(optimizer.state[p] for p in model.parameters()) or not optimizer.defaults.get("momentum", 1)
    data = torch.randn(5, 32, 8, generator=torch.Generator().manual_seed(1))
    for x in data:
        optimizer.zero_grad()
        model(x).pow(2).mean().backward()
        optimizer.step()
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize("make", [
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1),
    lambda ps: torch.optim.AdamW(ps, lr=1e-2, amsgrad=True, foreach=True),
    lambda ps: torch.optim.Adam(ps, lr=torch.tensor(1e-2), foreach=False),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    lambda ps: torch.optim.SGD(ps, lr=0.1),
], ids=["adamw", "adamw-amsgrad-foreach", "adam-tensor-lr", "sgd-nesterov", "sgd-momentum-foreach", "sgd-plain"])
def test_created_state_trains_bit_for_bit_as_the_lazy_one(make):
    for created, lazy in zip(_train(make, True), _train(make, False), strict=True):
        assert torch.equal(created, lazy)


def test_a_first_step_it_cannot_match_is_left_to_torch():
    """SGD with dampening copies the first gradient into its buffer undamped: a zero buffer would damp it."""
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, dampening=0.5)
    assert not create_state(optimizer) and not optimizer.state
