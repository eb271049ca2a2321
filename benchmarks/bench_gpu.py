"""The curve on a CUDA device, in one command and at most five minutes.

    .venv/bin/python benchmarks/bench_gpu.py [--batches 1,4,16,32] [--repeat 2]
        [--layers all] [--budget 240]

Without a CUDA device it prints ``skipped: no CUDA device`` and exits 0. With one it names
the device and runs `bench_curve`'s curve there: SmolLM2-135M loaded onto the device, B
bare forward+backward passes against the same passes with the four default probes and
then `results()`, and `fit_bases` against B bare forwards, each time waiting for the
device's queued work (`_timing.device_timed`). After the curve it checks that every
probe's state is on the device and prints the device's peak memory. ``--budget`` seconds
(default 240, for the curve; loading and fitting the bases come before) stop it from
starting a further B or repeat once spent, so the whole run stays within five minutes;
the slopes are then fitted over the B that ran.
"""

from __future__ import annotations

import time
import warnings

import torch
from bench_curve import BATCH, POS, PROBES, curve, parser

from tangentlens import models
from tangentlens.probes import fit_bases, lm_loss, probe


def _states_on(device: torch.device) -> list[str]:
    """One short pass of the default probes on ``device``: the state tensors that are not
    on it (none is the answer)."""
    bridge, tok = models.load("smollm2-135m", device=str(device))
    gen = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, len(tok), (BATCH, POS), generator=gen).to(device) for _ in range(2)]
    bases = fit_bases(bridge, ids, rank=16, layers=[0, 1], progress=False)
    with probe(bridge, bases, PROBES, layers=[0, 1]) as session:
        for x in ids:
            lm_loss(bridge, x).backward()
            bridge.zero_grad(set_to_none=True)
    session.results(progress=False)
    off = []
    for name, p in session.probes.items():
        for key in {k.rsplit("/", 1)[0] for k in p.state_dict()}:  # state_dict copies to CPU
            for part, t in p.state(key).state_dict().items():
                if t.numel() > 1 and t.device.type != device.type:
                    off.append(f"{name}: {key}/{part} on {t.device}")
    return off


def main() -> None:
    ap = parser()
    ap.add_argument("--budget", type=float, default=240.0, help="seconds for the curve")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("skipped: no CUDA device")
        return
    device = torch.device("cuda")
    print(f"CUDA device: {torch.cuda.get_device_name(device)}", flush=True)
    warnings.simplefilter("ignore")
    torch.cuda.reset_peak_memory_stats(device)
    curve(args, device="cuda", deadline=time.monotonic() + args.budget)
    elsewhere = _states_on(device)
    print(f"probe state off the device: {elsewhere or 'none'}")
    print(f"peak device memory {torch.cuda.max_memory_allocated(device) / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
