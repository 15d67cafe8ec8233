"""torch's own scan (``torch._higher_order_ops.scan``, a prototype in torch 2.9) as inductor's scan over layers,
against the plain loop: why xbridge's inductor backend uses a nested compile region instead (docs/depth-and-memory.md).

A stack of residual MLP blocks (LayerNorm, 256 -> 1024 -> 256, GELU) over stacked parameters, one forward and
backward per step, run four ways: the loop and the scan, each in eager and under ``torch.compile`` (inductor). The
scan's body is written with ``torch.nn.functional`` calls on the layer's weights, because a module called through
``torch.func.functional_call`` inside it is refused by Dynamo ("scan must be captured completely"). Per way: the
first step (compile + one step), the median of 5 more, the loss, each layer's up-projection weight gradient (sum
of absolute values), what torch.compile could not compile (Dynamo's counters: graph breaks, and of those the
Inductor failures it fell back from), and the largest gradient difference from the eager loop. Prints a table,
writes torch_scan.json.

    .venv/bin/python bench/torch_scan.py [--layers 2] [--out bench/results/torch-scan]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch._higher_order_ops.scan import scan

HERE = Path(__file__).resolve().parent
WIDTH = 256


def block(x: torch.Tensor, w: dict[str, torch.Tensor]) -> torch.Tensor:
    h = F.layer_norm(x, (WIDTH,), w["norm_w"], w["norm_b"])
    return x + F.linear(F.gelu(F.linear(h, w["up_w"], w["up_b"])), w["down_w"], w["down_b"])


def loop(x: torch.Tensor, stacked: dict[str, torch.Tensor]) -> torch.Tensor:
    for i in range(next(iter(stacked.values())).shape[0]):
        x = block(x, {k: v[i] for k, v in stacked.items()})
    return x.square().mean()


def scanned(x: torch.Tensor, stacked: dict[str, torch.Tensor]) -> torch.Tensor:
    def body(carry: torch.Tensor, w: dict[str, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        return block(carry, w), carry.new_zeros(())

    out, _ = scan(body, x, stacked)
    return out.square().mean()


def weights(layers: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {"norm_w": (WIDTH,), "norm_b": (WIDTH,), "up_w": (4 * WIDTH, WIDTH), "up_b": (4 * WIDTH,),
              "down_w": (WIDTH, 4 * WIDTH), "down_b": (WIDTH,)}
    out = {}
    for name, shape in shapes.items():
        value = torch.randn(layers, *shape, generator=gen) * (0.02 if name.endswith("_w") and len(shape) == 2 else 1)
        out[name] = (value.abs() + 1 if name == "norm_w" else value).requires_grad_()
    return out


def measure(fn, layers: int, compiled: bool) -> dict:
    import torch._dynamo

    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    stacked = weights(layers)
    x = torch.randn(16, 256, WIDTH, generator=torch.Generator().manual_seed(1))
    step = torch.compile(fn) if compiled else fn
    times = []
    for _ in range(6):
        for value in stacked.values():
            value.grad = None
        start = time.perf_counter()
        loss = step(x, stacked)
        loss.backward()
        times.append(time.perf_counter() - start)
    # what Dynamo could not compile: its graph breaks, and the compiler failures it fell back from
    counters = torch._dynamo.utils.counters
    breaks = sum(counters["graph_break"].values()) + sum(counters["unimplemented"].values())
    failed = sum(n for reason, n in counters["unimplemented"].items() if reason.startswith("Backend compiler"))
    return {"first_step_s": times[0], "step_s": statistics.median(times[1:]), "loss": float(loss.detach()),
            "graph_breaks": breaks, "inductor_failures": failed,
            "grads": {k: v.grad.clone() for k, v in stacked.items()}}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--out", type=Path, default=HERE / "results" / "torch-scan")
    args = parser.parse_args()
    rows = []
    for form, fn in (("loop", loop), ("torch scan", scanned)):
        for compiled in (False, True):
            rows.append({"form": form, "mode": "inductor" if compiled else "eager",
                         **measure(fn, args.layers, compiled)})
    reference = rows[0]["grads"]
    print(f"{'form':10} {'mode':8} {'first step s':>12} {'step ms':>8} {'loss':>10} {'graph breaks':>12} "
          f"{'inductor failed':>15} {'max grad diff':>13}  up_w grad per layer (sum |g|)")
    for r in rows:
        grads = r.pop("grads")
        r["max_grad_diff"] = max(float((grads[k] - reference[k]).abs().max()) for k in grads)
        r["up_w_grad_per_layer"] = [float(g) for g in grads["up_w"].abs().sum((1, 2))]
        per_layer = ", ".join(f"{g:.3f}" for g in r["up_w_grad_per_layer"])
        print(f"{r['form']:10} {r['mode']:8} {r['first_step_s']:12.2f} {1e3 * r['step_s']:8.1f} {r['loss']:10.6f} "
              f"{r['graph_breaks']:12d} {r['inductor_failures']:15d} {r['max_grad_diff']:13.3g}  {per_layer}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "torch_scan.json"
    path.write_text(json.dumps({"layers": args.layers, "torch": torch.__version__, "rows": rows}, indent=2))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
