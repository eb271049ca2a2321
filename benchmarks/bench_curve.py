"""The curve: the probe pass's slope per batch and the fixed costs, as ratios to bare passes.

    .venv/bin/python benchmarks/bench_curve.py [--batches 1,4,16,32] [--repeat 2]
        [--layers all|0,5,10] [--breakdown] [--where] [--head-null N] [--driver run]
        [--quick]

On SmolLM2-135M (30 layers, d = 576) with the default bases of `fit_bases` (rank 16) and
the four default probes (residual, attention with its head null, gradient,
weight_gradient), batches of 4 × 128 tokens, for each B in ``--batches`` each repeat
measures, interleaved in one process:

- B bare forward+backward passes of the summed next-token loss, and the same B passes
  inside the probe session (the pass), then the session's `results()`;
- B bare forwards (no gradient), and `fit_bases` over the same B batches.

A line fitted over B (least squares, per repeat) splits each cost into a slope (per batch,
so per 512 tokens) and an intercept: the pass's slope over the bare slope is what every
further batch costs; `results()` is a fixed cost, reported in bare forward+backward passes
(the bare slope). ``end to end`` is (pass + results) / bare at each B; ``fit_bases`` is
its time over the B bare forwards. ``--breakdown`` adds each probe alone: its pass slope
over the bare slope, minus one (what it adds per batch). ``--where``: after the repeats,
one more pass over the largest B with a timer around each probe's per-batch step (the
weight gradient's fold and its activation energies, the attention split, the gradient and
residual updates), each in bare forward+backward passes of those batches, and the rest
(hooks and the probes' other work). ``--head-null N``: the attention
probe's null frames (0: none; its default null sees the first `HEAD_NULL_SEQUENCES`
sequences, a fixed cost that the line puts in the intercept). ``--driver run``: the pass
is `tangentlens.run` over the batches (its own loop, which takes the gradient with respect
to the embedding output only, so the backward skips every weight's ``.grad``) instead of
the caller's ``loss.backward()`` inside `probe`; each repeat then also times B bare passes
of that kind (``bare act``: the same loss and backward with no parameter requiring a
gradient), and the pass's slope is given over both bare slopes. ``--quick``: layers 0 and
1, B in 1, 2, one repeat (a smoke run).

Every figure is the median over repeats with its min–max. Timing on a shared machine is
noisy: compare ratios from one run, never absolute times across runs; the load average
is printed before and after.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from _timing import device_timed

import tangentlens.probes.weight_gradient as wg
from tangentlens import models
from tangentlens.probes import fit_bases, lm_loss, probe, run
from tangentlens.probes.attention import AttentionProbe
from tangentlens.probes.gradient import GradientProbe
from tangentlens.probes.residual import ResidualProbe

PROBES = ("residual", "attention", "gradient", "weight_gradient")
BATCH, POS = 4, 128
STEPS = {  # --where: each probe's per-batch step (none calls another)
    "weight_gradient fold (pooled_weight_gram)": (wg, "pooled_weight_gram"),
    "weight_gradient G Gᵀ of the weights' gradients": (wg.WeightGradientProbe, "_add_weight_gram"),
    "weight_gradient activation energies": (wg.WeightGradientProbe, "update"),
    "attention split (update)": (AttentionProbe, "update"),
    "gradient update_gradient": (GradientProbe, "update_gradient"),
    "gradient update (activations)": (GradientProbe, "update"),
    "residual update": (ResidualProbe, "update"),
}


@contextlib.contextmanager
def _timers(spent: Counter) -> Iterator[None]:
    """Each of `STEPS` wrapped to add its wall time to ``spent``."""

    def timed(label: str, fn: Callable) -> Callable:
        def wrapper(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                spent[label] += time.perf_counter() - start

        return wrapper

    with contextlib.ExitStack() as stack:
        for label, (owner, name) in STEPS.items():
            stack.enter_context(mock.patch.object(owner, name, timed(label, getattr(owner, name))))
        yield


def _line(xs: list[int], ys: list[float]) -> tuple[float, float]:
    """Least-squares slope and intercept of ys over xs (one point: through the origin)."""
    if len(set(xs)) < 2:
        return ys[0] / xs[0], 0.0
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sum(
        (x - mx) ** 2 for x in xs
    )
    return slope, my - slope * mx


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):6.2f}x  ({min(values):.2f}-{max(values):.2f})"


def parser() -> argparse.ArgumentParser:
    """The curve's options (`bench_gpu` reads the same)."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,4,16,32", help="comma-separated B values")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--layers", default="all", help="all, or comma-separated layer indices")
    ap.add_argument("--breakdown", action="store_true", help="also each probe alone")
    ap.add_argument("--where", action="store_true", help="time each probe's step in one pass")
    ap.add_argument(
        "--head-null",
        type=int,
        default=None,
        help="the attention probe's head_null frames (default: the probe's own)",
    )
    ap.add_argument(
        "--driver",
        choices=("probe", "run"),
        default="probe",
        help="the pass: loss.backward() inside probe (default), or tangentlens.run",
    )
    ap.add_argument("--quick", action="store_true", help="layers 0,1; B = 1,2; one repeat")
    return ap


def curve(args: argparse.Namespace, device: str = "cpu", deadline: float | None = None) -> None:
    """Time the curve of ``args`` on ``device`` and print it; on a device other than the
    CPU each time waits for the device's queued work (`_timing.device_timed`). Past
    ``deadline`` (a `time.monotonic` value) no further B is started: the slopes are then
    fitted over the B that ran."""
    if args.quick:
        args.layers, args.batches, args.repeat = "0,1", "1,2", 1
    warnings.simplefilter("ignore")
    print(f"load average {os.getloadavg()}, {torch.get_num_threads()} threads", flush=True)
    sizes = sorted({int(b) for b in args.batches.split(",")})
    bridge, tok = models.load("smollm2-135m", device=device)
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    gen = torch.Generator().manual_seed(0)
    fit = [torch.randint(0, len(tok), (BATCH, POS), generator=gen) for _ in range(2)]
    data = [torch.randint(0, len(tok), (BATCH, POS), generator=gen) for _ in range(sizes[-1])]
    fit, data = [x.to(device) for x in fit], [x.to(device) for x in data]
    bases = fit_bases(bridge, fit, rank=16, layers=layers, progress=False)

    def timed(fn: Callable[[], object]) -> float:
        return device_timed(fn, torch.device(device))

    def bare_fb(batches: list[torch.Tensor]) -> None:
        for ids in batches:
            lm_loss(bridge, ids).backward()
            bridge.zero_grad(set_to_none=True)

    params = [p for p in bridge.parameters() if p.requires_grad]

    def bare_act(batches: list[torch.Tensor]) -> None:
        """What `run`'s backward computes: the activations' gradients, no weight's."""
        for p in params:
            p.requires_grad_(False)
        hook = bridge.embed.register_forward_hook(lambda m, a, out: out.requires_grad_(True))
        try:
            for ids in batches:
                lm_loss(bridge, ids).backward()
        finally:
            hook.remove()
            for p in params:
                p.requires_grad_(True)

    def bare_fwd(batches: list[torch.Tensor]) -> None:
        with torch.no_grad():
            for ids in batches:
                bridge(ids)

    def session_pass(names: tuple[str, ...], batches: list[torch.Tensor]):
        null = (
            {}
            if args.head_null is None or "attention" not in names
            else {"head_null": args.head_null}
        )
        if args.driver == "run":
            ran_run: list = []
            t = timed(
                lambda: ran_run.append(
                    run(bridge, batches, bases, names, layers=layers, progress=False, **null)
                )
            )
            return ran_run[0], t
        with probe(bridge, bases, names, layers=layers, **null) as session:
            t = timed(lambda: bare_fb(batches))
        return session, t

    names = [("all", PROBES)] + ([(n, (n,)) for n in PROBES] if args.breakdown else [])
    out: dict[str, list[float]] = {}
    ran: list[int] = []  # the B of the first repeat; later repeats run the same
    for r in range(args.repeat):
        times: dict[str, list[float]] = {}
        for b in sizes if r == 0 else ran:
            if r == 0 and deadline is not None and len(ran) >= 2 and time.monotonic() > deadline:
                print(f"past the time budget: B > {ran[-1]} left out", flush=True)
                break
            batches = data[:b]
            for label, chosen in names:
                t_bare = timed(lambda bs=batches: bare_fb(bs))
                if args.driver == "run" and label == "all":
                    times.setdefault("bare act", []).append(timed(lambda bs=batches: bare_act(bs)))
                session, t_pass = session_pass(chosen, batches)
                times.setdefault(f"bare/{label}", []).append(t_bare)
                times.setdefault(f"pass/{label}", []).append(t_pass)
                if label == "all":
                    t_res = timed(lambda s=session: s.results(progress=False))
                    times.setdefault("results", []).append(t_res)
                    nbytes = sum(
                        t.nbytes for p in session.probes.values() for t in p.state_dict().values()
                    )
                del session
            t_fwd = timed(lambda bs=batches: bare_fwd(bs))
            t_fit = timed(
                lambda bs=batches: fit_bases(bridge, bs, rank=16, layers=layers, progress=False)
            )
            times.setdefault("fwd", []).append(t_fwd)
            times.setdefault("fit", []).append(t_fit)
            if r == 0:
                ran.append(b)
            print(
                f"repeat {r} B={b}: bare {times['bare/all'][-1]:.1f} s, "
                + (f"bare act {times['bare act'][-1]:.1f} s, " if "bare act" in times else "")
                + f"pass {times['pass/all'][-1]:.1f} s, "
                f"results {times['results'][-1]:.1f} s, state {nbytes / 2**20:.0f} MiB; "
                f"fwd {t_fwd:.1f} s, fit_bases {t_fit:.1f} s; load {os.getloadavg()[0]:.1f}",
                flush=True,
            )
        bare_slope, _ = _line(ran, times["bare/all"])
        for label, _ in names:
            slope, _ = _line(ran, times[f"pass/{label}"])
            own, _ = _line(ran, times[f"bare/{label}"])
            key = "pass slope" if label == "all" else f"{label} alone adds"
            out.setdefault(key, []).append(slope / own - (label != "all"))
        if args.driver == "run":
            act_slope, _ = _line(ran, times["bare act"])
            pass_slope, _ = _line(ran, times["pass/all"])
            out.setdefault("bare act slope", []).append(act_slope / bare_slope)
            out.setdefault("pass slope over bare act", []).append(pass_slope / act_slope)
        out.setdefault("results (fixed)", []).append(
            statistics.fmean(times["results"]) / bare_slope
        )
        fwd_slope, _ = _line(ran, times["fwd"])
        fit_slope, fit_fixed = _line(ran, times["fit"])
        out.setdefault("fit_bases slope", []).append(fit_slope / fwd_slope)
        out.setdefault("fit_bases fixed", []).append(fit_fixed / fwd_slope)
        for i, b in enumerate(ran):
            end = times["pass/all"][i] + times["results"][i]
            out.setdefault(f"end to end B={b}", []).append(end / times["bare/all"][i])
            out.setdefault(f"fit_bases B={b}", []).append(times["fit"][i] / times["fwd"][i])
        if deadline is not None and time.monotonic() > deadline and r + 1 < args.repeat:
            print(f"past the time budget: {args.repeat - r - 1} repeat(s) left out", flush=True)
            break
    if args.where:
        batches = data[: ran[-1]]
        t_bare = timed(lambda: bare_fb(batches))
        spent: Counter = Counter()
        with _timers(spent):
            _, t_pass = session_pass(PROBES, batches)
        print(f"\nwhere one pass of B={ran[-1]} goes, in bare fwd+bwd passes of those batches:")
        print(f"{'the pass, over the bare':>42}: {t_pass / t_bare:.2f}x")
        for label, seconds in spent.most_common():
            print(f"{label:>42}: +{seconds / t_bare:.2f}")
        rest = t_pass - t_bare - sum(spent.values())
        print(f"{'the rest (hooks, the probes other work)':>42}: +{rest / t_bare:.2f}")
    print(
        f"\nSmolLM2-135M on {device}, {len(bases)} bases, layers={args.layers}, B={ran}, "
        f"the pass through {'tangentlens.run' if args.driver == 'run' else 'probe + backward'}, "
        f"{BATCH}x{POS} tokens a batch, repeats={args.repeat}; load average {os.getloadavg()}"
    )
    print("slopes: per batch over the bare slope; fixed: in bare passes (fwd+bwd or fwd)")
    for key, values in out.items():
        print(f"{key:>24}: {_spread(values)}")


def main() -> None:
    curve(parser().parse_args())


if __name__ == "__main__":
    main()
