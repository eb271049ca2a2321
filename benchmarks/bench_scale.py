"""Scale benchmarks, each ratio measured in one run.

    .venv/bin/python benchmarks/bench_scale.py [--smollm2] [--repeat N]

1. Probe overhead on real models: the demo's trained model (d=128, 4 layers) and,
   with --smollm2, SmolLM2-135M (d=576, 30 layers): bare forward, bare forward+backward,
   and `probe(residual, gradient)` / `probes.run` around the same step (bases at
   resid_pre of every layer, rank 16).
2. Monte-Carlo controls: energy + isotropy tests with 20, 1,000 and 10,000 controls on
   the gradient Moments of one site, over the cost of the pass that produced them.
3. Memory: peak resident memory of `probes.run` over N and 10·N token batches, each in a
   fresh process (the statistics are O(sites·d²), independent of the token count).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
from bench_probes import build, interleaved

from tangentlens.core.significance import energy_test, isotropy_test
from tangentlens.probes import fit_bases, lm_loss, probe, run


def trained_model() -> tuple[torch.nn.Module, int]:
    from tangentlens import models
    from tangentlens.data.train import TrainConfig, train

    out = Path(tempfile.mkdtemp(prefix="tangentlens-bench-")) / "ckpt"
    train(TrainConfig(), out, progress=False)
    last = max(out.glob("step*"), key=lambda p: int(p.name[4:]))
    bridge, tok = models.load(str(last))
    return bridge, len(tok)


def smollm2() -> tuple[torch.nn.Module, int]:
    from tangentlens import models

    bridge, tok = models.load("smollm2-135m")
    return bridge, len(tok)


def overhead(name: str, model: torch.nn.Module, vocab: int, repeat: int) -> tuple:
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, vocab, (4, 128), generator=gen)
    fit = [torch.randint(0, vocab, (4, 128), generator=gen) for _ in range(2)]
    bases = fit_bases(
        model, fit, rank=16, sites=lambda n: n.endswith("hook_resid_pre"), progress=False
    )

    def bare_fwd() -> None:
        with torch.no_grad():
            model(ids)

    def bare() -> None:
        lm_loss(model, ids).backward()
        model.zero_grad(set_to_none=True)

    def probed() -> None:
        with probe(model, bases, ("residual", "gradient")):
            lm_loss(model, ids).backward()
        model.zero_grad(set_to_none=True)

    def driver() -> None:
        run(model, [ids], bases, ("residual", "gradient"), progress=False)

    t = interleaved({"fwd": bare_fwd, "fwd+bwd": bare, "probe": probed, "run": driver}, repeat)
    print(
        f"{name}: bare fwd {t['fwd'] * 1e3:.0f} ms, bare fwd+bwd {t['fwd+bwd'] * 1e3:.0f} ms | "
        f"probe(residual, gradient) {t['probe'] / t['fwd+bwd']:.2f}x fwd+bwd | "
        f"run() {t['run'] / t['fwd+bwd']:.2f}x fwd+bwd"
    )
    with probe(model, bases, ("residual", "gradient")) as session:
        lm_loss(model, ids).backward()
    return session, t["probe"]


def controls_cost(session, pass_seconds: float) -> None:
    site = next(iter(session.gradient.bases))
    grads, basis = session.gradient.moments()[site], session.gradient.bases[site]
    for n in (20, 1000, 10_000):
        t = time.perf_counter()
        energy_test(grads, basis, n_controls=n)
        isotropy_test(grads, basis, n_controls=n, zeta=0.1)
        dt = time.perf_counter() - t
        print(
            f"  {n:>6} controls at {site.hook_name} (d={basis.d}, k={basis.k}): {dt:.2f} s = "
            f"{dt / pass_seconds:.2f}x the probed pass that made the statistics"
        )


def _peak_rss_child(n_batches: int) -> None:
    model = build(256, 4, 128)
    gen = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 4096, (8, 128), generator=gen) for _ in range(n_batches)]
    bases = fit_bases(model, batches[:2], rank=16, progress=False)
    resid = {k: v for k, v in bases.items() if "ln1" not in k}
    run(model, batches, resid, ("residual", "gradient", "activation"), progress=False)
    print(json.dumps({"peak_kib": _vm_hwm_kib()}))


def _vm_hwm_kib() -> int:
    """This process's peak RSS (VmHWM). Not ru_maxrss: Linux carries that over from the
    forking parent, so a child of a large process would report the parent's peak."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    raise RuntimeError("no VmHWM in /proc/self/status (Linux only)")


def memory(n: int) -> None:
    peaks = {}
    for k in (n, 10 * n):
        out = subprocess.run(
            [sys.executable, __file__, "--child", str(k)], capture_output=True, text=True
        )
        peaks[k] = json.loads(out.stdout.strip().splitlines()[-1])["peak_kib"] / 1024
    ratio = peaks[10 * n] / peaks[n]
    print(
        f"peak RSS: {n} batches of 8x128 tokens {peaks[n]:.0f} MiB, {10 * n} batches "
        f"{peaks[10 * n]:.0f} MiB -> {ratio:.3f}x for 10x the tokens"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smollm2", action="store_true", help="also SmolLM2-135M")
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--child", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    if args.child is not None:
        _peak_rss_child(args.child)
        return
    print(f"torch threads {torch.get_num_threads()}")
    memory(3)
    session, seconds = overhead("trained demo model", *trained_model(), args.repeat)
    controls_cost(session, seconds)
    if args.smollm2:
        session, seconds = overhead("SmolLM2-135M", *smollm2(), args.repeat)
        controls_cost(session, seconds)


if __name__ == "__main__":
    main()
