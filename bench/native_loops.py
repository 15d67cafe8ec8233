"""Hand-written training loops for the shipped programs, as a user of each stack would write them without xbridge.

They share only the model class and the batches with xbridge (the same network on the same data); the step,
optimizer, precision and compilation are written out here in each framework's own idiom. Used by
bench/overhead.py. Supported: AdamW and SGD specs, constant or warm-up+cosine schedules, fp32 and bf16-mixed,
no gradient accumulation; clipping by global norm.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np


def _lr(spec: Any, step: int) -> float:
    return spec.lr * spec.schedule.factor(step)


def _torch_optimizer(spec: Any, params: Any, lr: Any, capturable: bool) -> Any:
    import torch

    if type(spec).__name__ == "AdamW":
        return torch.optim.AdamW(params, lr=lr, betas=spec.betas, eps=spec.eps, weight_decay=spec.weight_decay,
                                 foreach=False, capturable=capturable)
    return torch.optim.SGD(params, lr=lr, momentum=spec.momentum, dampening=spec.dampening,
                           weight_decay=spec.weight_decay, nesterov=spec.nesterov, foreach=False)


def torch_eager(program: Any, weights: dict[str, np.ndarray]) -> Callable[[dict[str, np.ndarray]], float]:
    import torch

    model = program.model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    spec = program.optimizer
    opt = _torch_optimizer(spec, model.parameters(), spec.lr, capturable=False)
    mixed = program.precision.compute == "bfloat16"
    state = {"step": 0}

    def step(batch: dict[str, np.ndarray]) -> float:
        for group in opt.param_groups:
            group["lr"] = _lr(spec, state["step"])
        opt.zero_grad(set_to_none=True)
        tensors = {k: torch.from_numpy(v) for k, v in batch.items()}
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            out = program.loss(model, tensors)
        loss = out.float()
        loss.backward()
        if program.step.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), program.step.clip_grad_norm, foreach=False)
        opt.step()
        state["step"] += 1
        return loss.item()

    return step


def torch_compiled(program: Any, weights: dict[str, np.ndarray]) -> Callable[[dict[str, np.ndarray]], float]:
    """torch.compile as its tutorials show it: a compiled loss function and a compiled optimizer step, with the
    learning rate in a tensor so that the schedule does not recompile."""
    import torch

    model = program.model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    spec = program.optimizer
    lr = torch.tensor(spec.lr, requires_grad=True)
    opt = _torch_optimizer(spec, model.parameters(), lr, capturable=True)
    mixed = program.precision.compute == "bfloat16"

    @torch.compile
    def loss_fn(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=mixed):
            return program.loss(model, tensors).float()

    @torch.compile
    def update() -> None:
        opt.step()

    state = {"step": 0}

    def step(batch: dict[str, np.ndarray]) -> float:
        with torch.no_grad():
            lr.fill_(_lr(spec, state["step"]))
        opt.zero_grad(set_to_none=True)
        loss = loss_fn({k: torch.from_numpy(v) for k, v in batch.items()})
        loss.backward()
        if program.step.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), program.step.clip_grad_norm, foreach=False)
        update()
        state["step"] += 1
        return loss.item()

    return step


def torch_xla_lazy(program: Any, weights: dict[str, np.ndarray]) -> Callable[[dict[str, np.ndarray]], float]:
    import torch
    import torch_xla

    device = torch_xla.device()
    model = program.model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    model.to(device)
    spec = program.optimizer
    lr = torch.tensor(spec.lr, device=device, requires_grad=True)   # a device lr: no recompiles as it changes
    opt = _torch_optimizer(spec, model.parameters(), lr, capturable=True)
    mixed = program.precision.compute == "bfloat16"

    def train(tensors: dict[str, torch.Tensor]) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("xla", dtype=torch.bfloat16, enabled=mixed):
            out = program.loss(model, tensors)
        loss = out.float()
        loss.backward()
        if program.step.clip_grad_norm:
            torch.nn.utils.clip_grad_norm_(model.parameters(), program.step.clip_grad_norm, foreach=False)
        opt.step()
        return loss

    compiled = torch_xla.compile(train, full_graph=True)
    state = {"step": 0}

    def step(batch: dict[str, np.ndarray]) -> float:
        with torch.no_grad():
            lr.fill_(_lr(spec, state["step"]))
        loss = compiled({k: torch.from_numpy(v).to(device) for k, v in batch.items()})
        state["step"] += 1
        return loss.item()

    return step


def jax_torchax(program: Any, weights: dict[str, np.ndarray]) -> Callable[[dict[str, np.ndarray]], float]:
    """torchax.extract_jax for the forward pass, the loss written in JAX, optax for the update, one jax.jit."""
    import jax
    import jax.numpy as jnp
    import optax
    import torch
    import torchax

    model = program.model()
    model.load_state_dict({k: torch.from_numpy(v) for k, v in weights.items()})
    params, forward = torchax.extract_jax(model)
    params = {k: jnp.asarray(weights[k]) if k in weights else v for k, v in params.items()}
    spec = program.optimizer
    def schedule(count):
        return spec.lr * spec.schedule.factor_array(count, jnp)

    if type(spec).__name__ == "AdamW":
        tx = optax.adamw(schedule, b1=spec.betas[0], b2=spec.betas[1], eps=spec.eps, eps_root=0.0,
                         weight_decay=spec.weight_decay)
    else:
        tx = optax.chain(optax.add_decayed_weights(spec.weight_decay),
                         optax.sgd(schedule, momentum=spec.momentum or None, nesterov=spec.nesterov))
    if program.step.clip_grad_norm:
        tx = optax.chain(optax.clip_by_global_norm(program.step.clip_grad_norm), tx)
    opt_state = tx.init(params)
    mixed = program.precision.compute == "bfloat16"

    def loss_fn(p: Any, batch: dict[str, jax.Array]) -> jax.Array:
        if mixed:
            p = jax.tree.map(lambda a: a.astype(jnp.bfloat16) if a.ndim >= 2 else a, p)
        if "tokens" in batch:   # programs/gpt.py: next-byte prediction
            tokens = batch["tokens"]
            logits = forward(p, (tokens[:, :-1],)).astype(jnp.float32)
            return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
        logits = forward(p, (batch["x"].astype(jnp.bfloat16 if mixed else jnp.float32),)).astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch["y"]).mean()

    def train_step(p: Any, s: Any, batch: dict[str, jax.Array]) -> tuple[Any, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(p, batch)
        updates, s = tx.update(grads, s, p)
        return optax.apply_updates(p, updates), s, loss

    train = jax.jit(train_step, donate_argnums=(0, 1))
    state = {"params": params, "opt": opt_state}

    def step(batch: dict[str, np.ndarray]) -> float:
        device_batch = {k: jnp.asarray(v.astype(np.int32) if v.dtype == np.int64 else v) for k, v in batch.items()}
        state["params"], state["opt"], loss = train(state["params"], state["opt"], device_batch)
        return float(loss)

    return step


NATIVE = {"eager": torch_eager, "inductor": torch_compiled, "xla": torch_xla_lazy, "jax": jax_torchax}
TARGET = {"eager": "eager-cpu", "inductor": "inductor-cpu", "xla": "xla-cpu", "jax": "jax-cpu"}
