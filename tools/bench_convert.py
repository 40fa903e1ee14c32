"""Benchmark: `nereus convert` HF -> tp=2,pp=2 -> HF against a plain safetensors copy.

    python tools/bench_convert.py [--size-gib 2.0] [--dir /tmp] [--out bench_results/convert.json]

A Llama-shaped bf16 model (hidden 2048, 16 heads / 4 KV heads, intermediate 5632, vocab
32000, untied embeddings; layers chosen for ``--size-gib``) is written as one HF
``model.safetensors`` on local disk. Then, each in a fresh spawned process (so every
phase's peak RSS is its own and no phase inherits another's memory):

- copy: ``safetensors.torch.load_file`` + ``save_file`` of the same file (the reference);
- to_nereus: ``convert(hf, n, to="tp=2,pp=2")`` — every box of the tp=2,pp=2 layout
  written through the DCP writer with its block checksums, then the manifest commit;
- to_hf: ``convert(n, hf2, to="hf")`` — every box read through the staged reader and
  checked against its checksums, streamed into ``model.safetensors``, renamed into place.

Each set runs twice: without fsync (the plain copy's durability: the page cache; the
headline ``convert_over_copy``), and with fsync on both sides (the copy then fsyncs its
file; conversions fsync every file before the commit, as ``nereus convert`` does by
default: ``convert_over_copy_fsync``). Seconds are measured inside each process around
the call alone (no interpreter start), after ``sync`` so no phase flushes another's
writes; each phase runs ``--repeat`` times (interleaved with the others, the copy first,
in the middle and last in turn) and the median counts. Before any timing, all free memory but 1 GiB is touched once in a throwaway
process: on a VM, writing into guest memory never touched before is several times slower
than into memory used before, which would otherwise favour whichever phase runs second. Throughput = model bytes / seconds (each leg, like the copy, reads and writes the
model's bytes once); ``convert_over_copy`` = (2 x bytes / (to_nereus + to_hf seconds)) /
(bytes / copy seconds), the conversions' mean throughput over the copy's. The output is
checked bit for bit against the input. Bars: convert_over_copy >= 0.5; every
conversion's peak RSS (whole process, ~360 MiB of it torch + tensorstore imports) <=
2 x largest tensor + 512 MiB. The last printed line is one JSON object whose first keys
are ``convert_over_copy``, ``peak_rss_bytes``, ``largest_tensor_bytes``; the machine is
shared, so compare the ratios of one run, not absolute seconds.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import resource
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

HIDDEN, HEADS, KV_HEADS, INTER, VOCAB = 2048, 16, 4, 5632, 32000
MIB = 2**20


def model_config(size_gib: float) -> dict:
    per_layer = 2 * (2 * HIDDEN * HIDDEN + 2 * HIDDEN * HIDDEN * KV_HEADS // HEADS + 3 * HIDDEN * INTER + 2 * HIDDEN)
    fixed = 2 * (2 * VOCAB * HIDDEN + HIDDEN)
    layers = max(2, round((size_gib * 2**30 - fixed) / per_layer))
    return {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": VOCAB, "hidden_size": HIDDEN,
        "intermediate_size": INTER, "num_hidden_layers": layers, "num_attention_heads": HEADS,
        "num_key_value_heads": KV_HEADS, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
    }


def _cpu() -> float:
    """CPU seconds of this process so far, all threads, user + system."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB


def _phase(name: str, args: tuple, queue) -> None:
    """Child body: run one phase, report (seconds, peak RSS before, peak RSS after)."""
    import torch

    torch.set_num_threads(1)
    from safetensors.torch import load_file, save_file

    from nereus.store.convert import convert

    rss_before = _peak_rss()
    t0, cpu0 = time.perf_counter(), _cpu()
    if name == "generate":
        out, config = args
        from nereus.reshard.derive import plan_parameters
        from nereus.store.hf import HFWriter, spec_from_hf_config

        spec = spec_from_hf_config(config)
        entries = [(n, "bfloat16", tuple(s)) for n, s, _, _ in plan_parameters(spec)]
        writer = HFWriter(out, entries, config, sync=False)
        gen = torch.Generator().manual_seed(0)
        for n, _, s in entries:
            writer.write(n, torch.randn(s, generator=gen).to(torch.bfloat16))
        writer.close()
    elif name == "copy":
        src, dst, sync = args
        save_file(load_file(src), dst)
        if sync:
            fd = os.open(dst, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)
    elif name == "convert":
        src, dst, to, sync = args
        convert(src, dst, to=to, sync=sync)
    elif name == "warm":
        (nbytes,) = args  # see ``main``: back guest memory before anything is timed
        block = torch.ones(nbytes, dtype=torch.uint8)
        del block
    elif name == "check":
        a, b = args
        from nereus.store.hf import HFCheckpoint

        x, y = HFCheckpoint.open(a), HFCheckpoint.open(b)
        assert sorted(x.tensors) == sorted(y.tensors)
        for n in x.tensors:
            if not torch.equal(x.read(n).view(torch.int16), y.read(n).view(torch.int16)):
                raise AssertionError(f"tensor {n} differs after the round trip")
    queue.put((time.perf_counter() - t0, rss_before, _peak_rss(), _cpu() - cpu0))


def run_phase(name: str, *args) -> tuple[float, int, int]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_phase, args=(name, args, queue))
    proc.start()
    proc.join()
    if proc.exitcode != 0:
        raise RuntimeError(f"phase {name} failed with exit code {proc.exitcode}")
    return queue.get(timeout=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size-gib", type=float, default=2.0)
    parser.add_argument("--dir", default=None, help="Working directory on local disk (default: a temp dir in /tmp).")
    parser.add_argument("--out", default="bench_results/convert.json")
    parser.add_argument("--keep", action="store_true", help="Keep the working directory.")
    parser.add_argument("--repeat", type=int, default=3, help="Runs per phase; the median is reported.")
    parser.add_argument("--verbose", action="store_true", help="Print every run's seconds.")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nereus-bench-convert-", dir=args.dir))
    config = model_config(args.size_gib)
    results: dict[tuple[str, bool], tuple[float, int, int]] = {}
    try:
        hf = str(work / "hf")
        run_phase("generate", hf, config)
        # On a VM, the first write into never-touched guest memory (page cache included) runs
        # ~4x slower than into memory used before, and the kernel hands out free pages in no
        # fixed order: touch all free memory but 1 GiB once, so every phase below writes into
        # memory the VM already backs, the copy as much as the conversions.
        avail = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        run_phase("warm", max(0, int(avail - 2**30)))
        src_file = os.path.join(hf, "model.safetensors")
        model_bytes = os.path.getsize(src_file)
        from nereus.reshard.derive import plan_parameters
        from nereus.store.hf import spec_from_hf_config

        largest = max(math.prod(s) * 2 for _, s, _, _ in plan_parameters(spec_from_hf_config(config)))
        for sync in (False, True):
            tag = "sync" if sync else "nosync"
            runs: dict[str, list] = {"copy": [], "to_nereus": [], "to_hf": []}
            phases = {
                "copy": ("copy", src_file, str(work / "copy.safetensors"), sync),
                "to_nereus": ("convert", hf, str(work / "nereus"), "tp=2,pp=2", sync),
                "to_hf": ("convert", str(work / "nereus"), str(work / "hf2"), "hf", sync),
            }
            for rep in range(args.repeat):  # interleaved; the copy's place rotates (first, middle, last)
                for path in ("copy.safetensors", "nereus", "hf2"):
                    p = work / path
                    shutil.rmtree(p, ignore_errors=True) if p.is_dir() else p.unlink(missing_ok=True)
                order = ["to_nereus", "to_hf"]
                order.insert(rep % 3, "copy")
                for name in order:
                    os.sync()
                    runs[name].append(run_phase(*phases[name]))
                os.sync()
            run_phase("check", hf, str(work / "hf2"))
            if args.verbose:
                print("  seconds (CPU seconds) per run:", {k: [f"{v[0]:.2f} ({v[3]:.2f})" for v in vs] for k, vs in runs.items()}, flush=True)
            for name, values in runs.items():  # median seconds; peak RSS over all runs
                results[name, sync] = (statistics.median(v[0] for v in values), min(v[1] for v in values),
                                       max(v[2] for v in values), statistics.median(v[3] for v in values))
            print(f"  ({tag} round done: {args.repeat} runs per phase)", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)

    def ratio(sync: bool) -> float:
        conv_s = results["to_nereus", sync][0] + results["to_hf", sync][0]
        return (2 * model_bytes / conv_s) / (model_bytes / results["copy", sync][0])

    convert_over_copy, durable = ratio(False), ratio(True)
    peak = max(results[leg, sync][2] for leg in ("to_nereus", "to_hf") for sync in (False, True))
    bar_rss = 2 * largest + 512 * MIB
    rows = [("phase", "fsync", "seconds", "GB/s", "CPU s", "peak RSS MiB", "RSS after imports MiB")]
    for sync in (False, True):
        for name in ("copy", "to_nereus", "to_hf"):
            sec, before, after, cpu = results[name, sync]
            rows.append((name, "yes" if sync else "no", f"{sec:.2f}", f"{model_bytes / sec / 1e9:.2f}", f"{cpu:.2f}",
                         f"{after / MIB:.0f}", f"{before / MIB:.0f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    print(f"model: {config['num_hidden_layers']} layers, {model_bytes / 2**30:.2f} GiB bf16, "
          f"largest tensor {largest / MIB:.0f} MiB, load average {os.getloadavg()[0]:.2f}")
    for r in rows:
        print("  ".join(c.rjust(w) for c, w in zip(r, widths)))
    print(f"convert_over_copy = {convert_over_copy:.2f} without fsync, {durable:.2f} with fsync on both sides "
          f"(bar >= 0.5): {'PASS' if convert_over_copy >= 0.5 else 'FAIL'}")
    print(f"peak RSS of a conversion = {peak / MIB:.0f} MiB (bar <= 2 x {largest / MIB:.0f} + 512 = "
          f"{bar_rss / MIB:.0f} MiB): {'PASS' if peak <= bar_rss else 'FAIL'}")
    record = {
        "convert_over_copy": round(convert_over_copy, 4),
        "peak_rss_bytes": peak,
        "largest_tensor_bytes": largest,
        "convert_over_copy_fsync": round(durable, 4),
        "model_bytes": model_bytes,
        "rss_bar_bytes": bar_rss,
        **{f"{name}_{'fsync' if sync else 'nosync'}_s": round(results[name, sync][0], 3)
           for name in ("copy", "to_nereus", "to_hf") for sync in (False, True)},
        "copy_peak_rss_bytes": results["copy", False][2],
        **{f"{name}_nosync_cpu_s": round(results[name, False][3], 3) for name in ("copy", "to_nereus", "to_hf")},
    }
    if args.out:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(record, f, indent=2)
    print(json.dumps(record))


if __name__ == "__main__":
    main()
