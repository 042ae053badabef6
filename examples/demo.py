"""gograph demo: graph a small launch-bound model, train it, and print what graphing gained.

On a machine with an NVIDIA GPU this captures the model's forward and backward into CUDA graphs
with the Go core and compares, over the same training steps, against the eager model and against
torch.cuda.make_graphed_callables: step time, memory the graphs keep, and whether the trained
parameters are bitwise equal. Without a GPU it runs the same code on gograph's eager engine (the
CPU reference that replays by re-running the callable) and says so.
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch

import gograph


def make_model(width: int, depth: int, device: torch.device) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(depth):
        layers += [torch.nn.Linear(width, width), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers).to(device)


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def train(model, data, targets, device, steps: int) -> float:
    """Runs `steps` SGD steps over the batches; returns seconds per step (after 3 untimed)."""
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    t0 = None
    for i in range(steps + 3):
        if i == 3:
            sync(device)
            t0 = time.perf_counter()
        x, y = data[i % len(data)], targets[i % len(targets)]
        opt.zero_grad(set_to_none=False)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
    sync(device)
    return (time.perf_counter() - t0) / steps


def time_rounds(models: dict, data, targets, device, steps: int, rounds: int = 5) -> dict:
    """Trains every model ``steps`` steps in ``rounds`` alternating rounds (each model the same
    batches in the same order, so their parameters stay comparable); the median seconds per
    step of each, from rounds run side by side (one noisy moment hits every arm alike)."""
    per_round = max(1, steps // rounds)
    seen: dict = {name: [] for name in models}
    for _ in range(rounds):
        for name, model in models.items():
            seen[name].append(train(model, data, targets, device, per_round))
    return {name: statistics.median(ts) for name, ts in seen.items()}


def allocated(device: torch.device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--depth", type=int, default=16)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--steps", type=int, default=50)
    args = p.parse_args()

    use_cuda = torch.cuda.is_available() and gograph.cuda_available()
    device = torch.device("cuda" if use_cuda else "cpu")
    if use_cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
        print(f"gograph {gograph.__version__}: CUDA engine on {torch.cuda.get_device_name(device)}")
    else:
        print(
            f"gograph {gograph.__version__}: no usable GPU ({gograph.cuda_unavailable_reason()}); "
            "running the eager engine (CPU reference: same API and lifecycle, no graphs)"
        )

    g = torch.Generator(device="cpu").manual_seed(1)
    data = [torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(4)]
    targets = [torch.randn(args.batch, args.width, generator=g).to(device) for _ in range(4)]
    sample = (torch.randn(args.batch, args.width, device=device),)

    eager = make_model(args.width, args.depth, device)
    models = {"eager": eager}
    retained = {}
    makers = [("gograph", gograph.make_graphed_callables)]
    if use_cuda:
        makers.append(("torch.cuda", torch.cuda.make_graphed_callables))
    for name, make in makers:
        model = make_model(args.width, args.depth, device)
        sync(device)
        gc.collect()
        before = allocated(device)
        models[name] = make(model, sample)
        sync(device)
        retained[name] = allocated(device) - before
    times = time_rounds(models, data, targets, device, args.steps)
    eager_t = times["eager"]
    results = {}
    for name in retained:
        same = all(torch.equal(a, b) for a, b in zip(eager.parameters(), models[name].parameters()))
        results[name] = (times[name], retained[name], same)
    models["gograph"].reset()
    del models
    gc.collect()

    print(
        f"model: {args.depth} x (Linear({args.width},{args.width}) + ReLU), batch {args.batch}, "
        f"{args.steps} timed SGD steps in alternating rounds (median per step)"
    )
    if not use_cuda:  # timings on the eager engine are noise: say what was checked instead
        _, _, same = results["gograph"]
        print(
            f"  eager engine: trained {args.steps} steps through the graphed model's API (static buffers,\n"
            f"  replays, reset); parameters bitwise equal to eager training: {same}. Run on an NVIDIA GPU\n"
            "  for CUDA graphs, their speed and their memory."
        )
    else:
        print(f"  eager              {eager_t * 1e3:8.3f} ms/step")
        for name, (step, retained, same) in results.items():
            print(
                f"  {name:<18} {step * 1e3:8.3f} ms/step  x{eager_t / step:5.2f} vs eager  "
                f"graph memory kept {retained / 2**20:7.2f} MiB  params bitwise equal to eager: {same}"
            )
    if use_cuda and not results["torch.cuda"][2]:
        print(
            "  torch.cuda's graphed parameters drift from eager: it hands the static grad buffer itself to\n"
            "  AccumulateGrad (pytorch#181723), so .grad aliases memory the next replay overwrites;\n"
            "  gograph returns owned parameter grads"
        )
    if not results["gograph"][2]:
        raise SystemExit("gograph's graphed training diverged from eager training")


if __name__ == "__main__":
    main()
