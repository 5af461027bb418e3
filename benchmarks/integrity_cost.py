"""The integrity check's cost per optimizer step (``update/external_changed``, ``rl_guard/stats/update.py``).

    python benchmarks/integrity_cost.py [--hidden 256] [--layers 4] [--steps 60]

On the demo's tiny Llama (built locally; hidden 256 and 4 layers: the 2.4M parameters of ``trl_overhead.py``'s larger
setup), one CPU thread: the update probe's ``pre_step`` + ``post_step`` around a real AdamW step, with the
fingerprints on and off (two probes, steps interleaved, the first 10 dropped, medians), one fingerprint pass alone,
and the exact norm's pass over the same tensors for scale.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

from json_output import add_json_argument, emit_json


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=60)
    add_json_argument(ap)
    a = ap.parse_args(argv)
    import torch
    from transformers import AutoModelForCausalLM

    from rl_guard.demo.tiny import build_tiny_model
    from rl_guard.stats import update
    from rl_guard.stats.grads import squares

    torch.set_num_threads(1)
    model = AutoModelForCausalLM.from_pretrained(build_tiny_model(tempfile.mkdtemp(), hidden=a.hidden, layers=a.layers))
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    groups, real = [params], update._Layout.fingerprints

    def step(probe) -> float:
        t0 = time.perf_counter()
        probe.pre_step(groups, [1e-3])
        t1 = time.perf_counter()
        opt.step()
        t2 = time.perf_counter()
        probe.post_step(groups)
        return t1 - t0 + time.perf_counter() - t2

    on, off = update.UpdateProbe(), update.UpdateProbe()
    with_fp, without = [], []
    for _ in range(a.steps):
        update._Layout.fingerprints = real
        with_fp.append(step(on))
        update._Layout.fingerprints = lambda self: None
        without.append(step(off))
    update._Layout.fingerprints = real
    layout = on._layout
    fp, norm = [], []
    for _ in range(50):
        t0 = time.perf_counter()
        layout.fingerprints()
        t1 = time.perf_counter()
        squares(layout.big)
        fp.append(t1 - t0)
        norm.append(time.perf_counter() - t1)
    ms = lambda xs: round(1e3 * statistics.median(xs), 3)  # noqa: E731
    out = {
        "parameters": sum(p.numel() for p in params),
        "large_tensors": len(layout.big),
        "probe_ms_with": ms(with_fp[10:]),
        "probe_ms_without": ms(without[10:]),
        "integrity_ms_per_step": round(ms(with_fp[10:]) - ms(without[10:]), 3),
        "fingerprint_pass_ms": ms(fp),
        "norm_pass_ms": ms(norm),
    }
    for k, v in out.items():
        print(f"{k}: {v}")
    emit_json(a.json, out)
    return out


if __name__ == "__main__":
    main()
