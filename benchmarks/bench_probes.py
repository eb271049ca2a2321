"""Probe overhead benchmark, all ratios measured in one run.

    .venv/bin/python benchmarks/bench_probes.py [--quick] [--repeat N] [--threads T]

Model: a TransformerLens native bridge, 4 layers, d_model 256, 8 heads, vocab 4096,
random weights; batch 8 × 128 tokens; bases of rank 16 at resid_pre, resid_mid and
resid_post of every layer (12 sites) and at every attention input.

1. bare: forward + summed next-token loss + ``loss.backward()``.
2. probed: the same user code inside ``probe(model, bases, ("residual", "gradient"))``
   (residual shares at 12 sites and 8 block writes, activation and gradient Moments at
   12 sites). Goal: at most 1.5× bare.
3. ``run(...)``: the driver, which takes gradients with respect to the embedding
   output only (no weight gradients), so it can be cheaper than bare.
4. attention probe alone (TT/TN/NT/NN/bias for every head of every layer), forward only,
   against a bare forward.
5. by hand: ``run_with_cache(incl_bwd=True)`` at the same 12 sites, then numpy
   (float64 shares and gradient second moments) — what the probes replace.

Bare and probed steps alternate, so machine load affects both alike; each figure is
the median of ``--repeat`` steps after a warm-up. The one-off statistics cost of
``results()`` (energy and isotropy tests, 1000 controls per site) is reported apart.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings

import numpy as np
import torch

from tangentlens.probes import fit_bases, lm_loss, probe, run


def build(d_model: int, n_layers: int, n_ctx: int) -> torch.nn.Module:
    from transformer_lens.config import TransformerBridgeConfig
    from transformer_lens.model_bridge import TransformerBridge

    cfg = TransformerBridgeConfig(
        d_model=d_model,
        d_head=32,
        n_heads=d_model // 32,
        n_layers=n_layers,
        n_ctx=n_ctx,
        d_vocab=4096,
        d_mlp=4 * d_model,
        act_fn="gelu",
        seed=0,
    )
    return TransformerBridge.boot_native(cfg).eval()


def median_time(fn, repeat: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def interleaved(fns: dict, repeat: int) -> dict[str, float]:
    """Median seconds per call of each function, calls interleaved round-robin."""
    for fn in fns.values():
        fn()  # warm-up
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeat):
        for name, fn in fns.items():
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: statistics.median(ts) for name, ts in times.items()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="d_model 128, 2 layers, 4 × 64")
    ap.add_argument("--repeat", type=int, default=7)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    d, n_layers, batch, pos = (128, 2, 4, 64) if args.quick else (256, 4, 8, 128)
    warnings.simplefilter("ignore", UserWarning)
    torch.manual_seed(0)
    model = build(d, n_layers, pos)
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 4096, (batch, pos), generator=gen)
    fit = [torch.randint(0, 4096, (batch, pos), generator=gen) for _ in range(2)]
    bases = fit_bases(model, fit, rank=16, progress=False)
    resid = {k: v for k, v in bases.items() if "ln1" not in k}
    print(
        f"torch threads {torch.get_num_threads()}; native bridge d_model={d}, layers={n_layers}, "
        f"batch {batch}×{pos}; {len(resid)} residual bases of rank 16"
    )

    def bare() -> None:
        model.zero_grad(set_to_none=True)
        lm_loss(model, ids).backward()

    def probed() -> None:
        model.zero_grad(set_to_none=True)
        with probe(model, resid, ("residual", "gradient")):
            lm_loss(model, ids).backward()

    def driver() -> None:
        run(model, [ids], resid, ("residual", "gradient"), progress=False)

    def bare_forward() -> None:
        with torch.no_grad():
            model(ids)

    def attention() -> None:
        with torch.no_grad(), probe(model, bases, ("attention",)):
            model(ids)

    names = list(resid)

    def by_hand() -> None:
        model.zero_grad(set_to_none=True)
        _, cache = model.run_with_cache(ids, names_filter=names, incl_bwd=True, return_type="loss")
        for name in names:
            q = resid[name].basis_.numpy()
            x = cache[name].detach().reshape(-1, d).numpy().astype(np.float64)
            _ = float(((x @ q) ** 2).sum() / (x**2).sum())
        for name in names:
            g = cache[name + "_grad"].detach().reshape(-1, d).numpy().astype(np.float64)
            _ = g.T @ g

    t = interleaved(
        {
            "bare": bare,
            "probed": probed,
            "run": driver,
            "by_hand": by_hand,
            "bare_fwd": bare_forward,
            "attention": attention,
        },
        args.repeat,
    )
    with probe(model, resid, ("residual", "gradient")) as session:
        lm_loss(model, ids).backward()
    model.zero_grad(set_to_none=True)
    t_results = median_time(session.results, 1)

    def line(label: str, key: str, ref: str) -> None:
        print(f"{label:<58} {t[key] * 1e3:8.1f} ms   {t[key] / t[ref]:5.2f}× {ref}")

    print(f"{'bare forward + backward':<58} {t['bare'] * 1e3:8.1f} ms")
    line("probe(residual, gradient) around the same fwd + bwd", "probed", "bare")
    line("probes.run(residual, gradient) driver", "run", "bare")
    line("by hand: run_with_cache(incl_bwd=True) + numpy", "by_hand", "bare")
    print(f"{'bare forward (no grad)':<58} {t['bare_fwd'] * 1e3:8.1f} ms")
    line("probe(attention), forward only, all layers and heads", "attention", "bare_fwd")
    print(
        f"{'session.results() once (tests, 1000 controls × 12 sites)':<58} "
        f"{t_results * 1e3:8.1f} ms"
    )


if __name__ == "__main__":
    main()
