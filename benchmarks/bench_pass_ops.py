"""Where the probe pass's extra time goes, by kind of operation (torch's profiler).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_pass_ops.py [--repeat 3] [--layers all]
        [--head-null 0] [--top 12] [--each] [--plumbing N]

On SmolLM2-135M with the default bases of `fit_bases` (rank 16) and the four default
probes (residual, attention, gradient, weight_gradient), one batch of 4 × 128 tokens: each
repeat times a pass inside an open probe session (its second batch, so no state is being
allocated) and a bare forward+backward, then profiles one of each, interleaved. The time
the session adds under the profiler is split by the ops it records on the calling thread
(where the CPU autograd engine also runs the backward), as multiples of the profiled bare
pass. An op the bare pass runs as often is the model's own; of an op run more often, the
extra calls are the probes':

- ``probes' products, float32`` / ``float64``: their matrix products (``mm``, ``bmm``,
  ``addmm``, ``dot``);
- ``probes' other ops``: everything else they run (copies and conversions, elementwise
  work, reductions, views, allocation);
- ``autograd engine``: the engine's own time around the backward's nodes, which includes
  the Python of gradient hooks;
- ``the model's own ops``: how much slower (or faster) they ran beside the probes;
- ``outside ops``: the profiled wall time that no op accounts for (Python: the forward
  hooks and the probes' own code between ops).

Printed: the unprofiled pass over the bare (median, min–max; one pass of each a repeat,
so it scatters with the one bare pass it divides by: ``--plumbing`` times the pass); the
probes' products alone (each (op, shapes, dtype) they add, replayed on random operands as
often as one pass calls it, unprofiled) with their GFLOP counted from the shapes: the
arithmetic the statistics need as they are computed; each kind's added time (median, min–max); the
``--top`` (op, shapes, dtype) entries with the most added time; with ``--each``, the ops
each probe alone adds. ``--plumbing N``: passes of N batches, unprofiled, interleaved over
the repeats (their order rotating): bare, in the session, and in the session with the
probes' statistics stubbed (`STUBS`: their per-batch updates no-ops, the weight gradient's
Grams zeros), so the hooks, masks, observations and the weight gradient's bookkeeping are
timed apart from the statistics, with each kind's minor page faults a batch (the kernel
zero-filling fresh memory; ``THP_MEM_ALLOC_ENABLE=1`` in the environment puts torch's
large CPU buffers on huge pages, a fault per 2 MiB instead of per 4 KiB). The profiler
costs per op (FLOP counting is left off: it multiplies that cost), so small ops read
slower under it than
they run: compare the kinds with each other, and the pass with the unprofiled ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import resource
import statistics
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from unittest import mock

import torch
from _timing import timed
from torch import Tensor
from torch.profiler import ProfilerActivity, profile

import tangentlens.probes.weight_gradient as wg
from tangentlens import models
from tangentlens.probes import fit_bases, lm_loss, probe
from tangentlens.probes.attention import AttentionProbe
from tangentlens.probes.gradient import GradientProbe
from tangentlens.probes.residual import ResidualProbe

PROBES = ("residual", "attention", "gradient", "weight_gradient")
BATCH, POS = 4, 128
PRODUCTS = {"aten::mm", "aten::bmm", "aten::addmm", "aten::dot"}
KINDS = (
    "probes' products, float32",
    "probes' products, float64",
    "probes' other ops",
    "autograd engine",
    "the model's own ops",
    "outside ops",
)
DTYPES = {"float": torch.float32, "double": torch.float64}

STUBS = {  # --plumbing: each probe's per-batch work; None: a no-op, else a zero d × d Gram
    (ResidualProbe, "update"): None,
    (AttentionProbe, "update"): None,
    (GradientProbe, "update"): None,
    (GradientProbe, "update_gradient"): None,
    (wg.WeightGradientProbe, "update"): None,
    (wg, "gradient_gram"): -2,  # G Gᵀ of G (d × out): d × d
    (wg, "pooled_weight_gram"): -1,  # of X (n × d) and the Δ: d × d
}

Key = tuple[str, tuple[tuple[int, ...], ...], str]  # (op, input shapes, first input's dtype)


def profiled(fn: Callable[[], None]) -> tuple[float, dict[Key, list[float]]]:
    """``(wall seconds, {key: [calls, self seconds]})`` of one call of ``fn``, over the ops
    recorded on this thread (no FLOP counting: it multiplies the profiler's cost per op)."""
    me = None
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as p:
        wall = timed(fn)
    ops: dict[Key, list[float]] = {}
    for e in p.events():
        me = e.thread if me is None else me
        if e.thread != me:
            continue
        dtype = str(e.input_dtypes[0]) if e.input_dtypes and e.input_dtypes[0] else ""
        shapes = tuple(tuple(s) for s in e.input_shapes or ())
        entry = ops.setdefault((e.name, shapes, dtype), [0, 0.0])
        entry[0] += 1
        entry[1] += e.self_cpu_time_total / 1e6
    return wall, ops


def operands(key: Key) -> tuple[Callable[..., Tensor], list[Tensor], float] | None:
    """``(op, random operands, GFLOP)`` to replay a product ``key``, or None."""
    name, shapes, dtype = key
    if name not in PRODUCTS or dtype not in DTYPES:
        return None
    make = lambda shape: torch.randn(shape, dtype=DTYPES[dtype])  # noqa: E731
    if name == "aten::addmm":
        (m, k), (_, n) = shapes[1], shapes[2]
        return torch.addmm, [make(shapes[0]), make((m, k)), make((k, n))], 2 * m * k * n / 1e9
    if name == "aten::mm":
        (m, k), (_, n) = shapes[0], shapes[1]
        return torch.mm, [make((m, k)), make((k, n))], 2 * m * k * n / 1e9
    if name == "aten::bmm":
        (b, m, k), (_, _, n) = shapes[0], shapes[1]
        return torch.bmm, [make((b, m, k)), make((b, k, n))], 2 * b * m * k * n / 1e9
    return torch.dot, [make(shapes[0]), make(shapes[1])], 2 * shapes[0][0] / 1e9


def replayed(calls: Counter) -> dict[str, list[float]]:
    """Per dtype, ``[seconds, GFLOP]`` of the products in ``calls`` ({key: calls a pass})
    run alone on random operands, each as often as a pass runs it, after one warm-up."""
    out = {"float": [0.0, 0.0], "double": [0.0, 0.0]}
    for key, n in calls.items():
        made = operands(key)
        if made is None or n <= 0:
            continue
        op, args, gflop = made
        op(*args)
        calls_n = round(n)
        out[key[2]][0] += timed(lambda op=op, args=args, k=calls_n: [op(*args) for _ in range(k)])
        out[key[2]][1] += gflop * calls_n
    return out


@contextlib.contextmanager
def stubbed() -> Iterator[None]:
    """`STUBS` in place: the hooks, masks, observations and the weight gradient's
    bookkeeping still run, the probes' statistics do not (a zero d × d Gram stands in for
    the weight gradient's products)."""

    def zero_gram(axis: int) -> Callable[..., Tensor]:
        def gram(x: Tensor, *_: object, **__: object) -> Tensor:
            return torch.zeros(x.shape[axis], x.shape[axis], dtype=torch.float64)

        return gram

    with contextlib.ExitStack() as stack:
        for (owner, name), axis in STUBS.items():
            stand_in = (lambda *_, **__: None) if axis is None else zero_gram(axis)
            stack.enter_context(mock.patch.object(owner, name, stand_in))
        yield


def kind_of(name: str, dtype: str) -> str:
    if name in PRODUCTS:
        return "probes' products, float64" if dtype == "double" else "probes' products, float32"
    return "probes' other ops"


def attribute(
    wall_b: float, ops_b: dict[Key, list[float]], wall_p: float, ops_p: dict[Key, list[float]]
) -> tuple[Counter, Counter, Counter]:
    """The session's added seconds by kind and by op, and the calls it added per op. An
    op the bare pass runs as often counts as the model's own (its change is the model's
    ops run again beside the probes); of an op run more often, the extra calls are the
    probes'."""
    kinds, by_op, calls = Counter(), Counter(), Counter()
    none = (0, 0.0)
    for key in ops_b.keys() | ops_p.keys():
        (n_b, t_b), (n_p, t_p) = ops_b.get(key, none), ops_p.get(key, none)
        if key[0].startswith("autograd::engine"):  # the hooks' Python runs inside these
            kinds["autograd engine"] += t_p - t_b
            by_op[key] += t_p - t_b
            continue
        own = t_p * min(n_b, n_p) / n_p if n_p else 0.0
        kinds["the model's own ops"] += own - t_b
        if n_p > n_b:
            share = (n_p - n_b) / n_p
            kinds[kind_of(key[0], key[2])] += t_p * share
            by_op[key] += t_p * share
            calls[key] += n_p - n_b
    kinds["outside ops"] = (wall_p - wall_b) - sum(kinds.values())
    return kinds, by_op, calls


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--layers", default="all", help="all, or comma-separated layer indices")
    ap.add_argument("--head-null", type=int, default=0, help="the attention probe's frames")
    ap.add_argument("--top", type=int, default=12, help="(op, shapes, dtype) entries to list")
    ap.add_argument("--each", action="store_true", help="also each probe alone, profiled once")
    ap.add_argument(
        "--plumbing",
        type=int,
        default=0,
        help="also N batches a pass, unprofiled: the session with its statistics stubbed",
    )
    args = ap.parse_args()
    warnings.simplefilter("ignore")
    load = os.getloadavg()[0]
    bridge, tok = models.load("smollm2-135m")
    layers = None if args.layers == "all" else [int(x) for x in args.layers.split(",")]
    gen = torch.Generator().manual_seed(0)
    fit = [torch.randint(0, len(tok), (BATCH, POS), generator=gen) for _ in range(2)]
    ids = torch.randint(0, len(tok), (BATCH, POS), generator=gen)
    bases = fit_bases(bridge, fit, rank=16, layers=layers, progress=False)

    def bare(batch: Tensor = ids) -> None:
        lm_loss(bridge, batch).backward()
        bridge.zero_grad(set_to_none=True)

    ratio: list[float] = []
    bare_s: list[float] = []
    added: dict[str, list[float]] = {k: [] for k in (*KINDS, "total")}
    by_op, calls = Counter(), Counter()
    bare()  # warm-up
    for _ in range(args.repeat):
        with probe(bridge, bases, PROBES, layers=layers, head_null=args.head_null):
            bare()  # the session's first batch allocates its state
            t_probed = timed(bare)
            wall_p, ops_p = profiled(bare)
        bare_s.append(timed(bare))
        ratio.append(t_probed / bare_s[-1])
        wall_b, ops_b = profiled(bare)
        kinds, ops, added_calls = attribute(wall_b, ops_b, wall_p, ops_p)
        for kind in KINDS:
            added[kind].append(kinds[kind] / wall_b)
        added["total"].append((wall_p - wall_b) / wall_b)
        by_op.update({key: seconds / args.repeat for key, seconds in ops.items()})
        calls.update({key: n / args.repeat for key, n in added_calls.items()})
    alone = replayed(calls)
    unit = statistics.median(bare_s)

    def spread(values: list[float]) -> str:
        return f"{statistics.median(values):+.3f}  ({min(values):+.3f} to {max(values):+.3f})"

    n_layers = "all" if layers is None else args.layers
    print(
        f"SmolLM2-135M, layers {n_layers}, {BATCH} x {POS} tokens, probes {', '.join(PROBES)}, "
        f"head_null={args.head_null}; {torch.get_num_threads()} threads; {args.repeat} repeats; "
        f"load average {load:.1f} before, {os.getloadavg()[0]:.1f} after; "
        f"bare fwd+bwd {unit:.2f} s"
    )
    print(
        f"the pass over the bare, unprofiled, one of each a repeat: "
        f"{statistics.median(ratio):.2f}x ({min(ratio):.2f}-{max(ratio):.2f})"
    )
    print("the probes' matrix products alone (random operands, as many calls as a pass):")
    for dtype, (seconds, gflop) in alone.items():
        print(f"  {DTYPES[dtype]}: {gflop:6.1f} GFLOP, {seconds / unit:+.3f} bare passes")
    print(f"  together: {sum(v[0] for v in alone.values()) / unit:+.3f} bare passes")
    n_ops = sum(calls.values())
    print(f"added by the session, profiled ({n_ops:.0f} ops more a pass), in profiled bare passes:")
    for kind, values in added.items():
        print(f"  {kind:<28} {spread(values)}")
    print(f"the {args.top} probes' (op, shapes, dtype) with the most time, ms a pass (mean):")
    for (name, shapes, dtype), seconds in by_op.most_common(args.top):
        print(f"  {seconds * 1e3:8.1f}  {name:<24} {dtype:<7} {str(shapes)[:60]}")
    for name in PROBES if args.each else ():
        with probe(bridge, bases, (name,), layers=layers, head_null=args.head_null):
            bare()
            wall_p, ops_p = profiled(bare)
        wall_b, ops_b = profiled(bare)
        added_calls = attribute(wall_b, ops_b, wall_p, ops_p)[2]
        print(
            f"{name} alone, profiled once: {sum(added_calls.values())} ops more a pass, "
            f"{(wall_p - wall_b) / wall_b:+.3f} profiled bare passes"
        )
    if args.plumbing:
        batches = [
            torch.randint(0, len(tok), (BATCH, POS), generator=gen) for _ in range(args.plumbing)
        ]

        def passes() -> None:
            for batch in batches:
                bare(batch)

        def session(stub: bool) -> Callable[[], None]:
            def run() -> None:
                with (
                    stubbed() if stub else contextlib.nullcontext(),
                    probe(bridge, bases, PROBES, layers=layers, head_null=args.head_null),
                ):
                    passes()

            return run

        runs = {"bare": passes, "the session": session(False), "stubbed": session(True)}
        times: dict[str, list[float]] = {name: [] for name in runs}
        faults: dict[str, list[int]] = {name: [] for name in runs}
        order = list(runs)
        for r in range(args.repeat):  # the order rotates: no kind always runs first or last
            for name in order[r % len(order) :] + order[: r % len(order)]:
                run = runs[name]
                before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
                times[name].append(timed(run))
                faults[name].append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
        print(f"{args.plumbing} batches a pass, unprofiled, over the bare (median, min-max):")
        for name in ("the session", "stubbed"):
            r = [t / b for t, b in zip(times[name], times["bare"], strict=True)]
            print(f"  {name:<12} {statistics.median(r):.2f}x ({min(r):.2f}-{max(r):.2f})")
        print(
            "minor page faults a batch (median): "
            + ", ".join(
                f"{k} {statistics.median(n) / args.plumbing:,.0f}" for k, n in faults.items()
            )
            + f"; THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE', 'unset')}"
        )


if __name__ == "__main__":
    main()
