"""Big-model inference: memory and speed of a model several times larger than its CPU budget.

A random transformers Llama (~820 MB of fp32 weights) is saved with ``save_pretrained`` in
shards; then, in fresh processes, two variants load it with ``load_checkpoint_and_dispatch``
and generate greedily from the same prompt:

* ``offloaded`` — ``device_map="auto"``, ``max_memory={"cpu": model / 4}`` and an offload
  folder: what does not fit stays in the checkpoint's own files and is read, memory-mapped,
  one layer at a time at each forward;
* ``in_memory`` — ``device_map={"": "cpu"}``: the whole model loaded.

Each process reports the peak of its resident memory (``VmHWM``) above what it held before
loading (Python, torch, transformers and the empty model), during loading and during
generation, and the generated tokens per second (after a warm-up). The variants alternate,
first one then the other, and the speed ratio is the median of the rounds' paired ratios. The target for the
offloaded peak is the budget plus the largest block (one decoder layer) plus a small
overhead; both variants must generate the same tokens. The checkpoint is freshly written,
so its pages are in the page cache: "disk" reads here cost memory bandwidth and page
faults, not a drive's latency. Run:

    python benchmarks/big_model.py           # ~820 MB model, 205 MB budget (~2 minutes)
    python benchmarks/big_model.py --quick   # a ~3 MB model (smoke test)
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from typing import Any

import torch
import workers  # benchmarks/workers.py, beside this script
from process_memory import reset_high_water_mark

VARIANTS = ("offloaded", "in_memory")
PROMPT = 16


def _status(field: str) -> int:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(field):
                return int(line.split()[1]) * 1024
    return 0


def _config(quick: bool) -> Any:
    from transformers import LlamaConfig

    width, inner, layers, vocab = (128, 384, 4, 512) if quick else (1024, 2816, 16, 8192)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=inner, num_hidden_layers=layers,
        num_attention_heads=16 if not quick else 4, num_key_value_heads=8 if not quick else 2,
        tie_word_embeddings=False,
    )  # fmt: skip


def worker(variant: str, checkpoint: str, quick: bool, new_tokens: int) -> None:
    from transformers import LlamaForCausalLM

    from slipstream import init_empty_weights, load_checkpoint_and_dispatch
    from slipstream.utils import compute_module_sizes

    torch.set_num_threads(2)
    with init_empty_weights():
        model = LlamaForCausalLM(_config(quick))
    sizes = compute_module_sizes(model)
    budget = sizes[""] // 4
    largest = max(sizes[f"model.layers.{i}"] for i in range(model.config.num_hidden_layers))
    largest = max(largest, sizes["model.embed_tokens"], sizes["lm_head"])
    reset_high_water_mark()
    before = _status("VmRSS:")
    started = time.perf_counter()
    if variant == "offloaded":
        model = load_checkpoint_and_dispatch(
            model, checkpoint, "auto", {"cpu": budget}, offload_folder=f"{checkpoint}-off"
        )
    else:
        model = load_checkpoint_and_dispatch(model, checkpoint, {"": "cpu"})
    load_seconds = time.perf_counter() - started
    load_peak = _status("VmHWM:") - before
    resident = sum(p.numel() * p.element_size() for p in model.parameters() if not p.is_meta)
    prompt = torch.randint(
        0, model.config.vocab_size, (1, PROMPT), generator=torch.Generator().manual_seed(0)
    )

    def generate(count: int) -> torch.Tensor:
        return model.generate(
            prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=count,
            min_new_tokens=count, do_sample=False, pad_token_id=0,
        )  # fmt: skip

    with torch.no_grad():
        generate(2)  # warm-up
        reset_high_water_mark()
        started = time.perf_counter()
        tokens = generate(new_tokens)
        seconds = time.perf_counter() - started
    workers.report(
        {
            "variant": variant,
            "model": sizes[""],
            "budget": budget,
            "largest": largest,
            "resident": resident,
            "load_peak": load_peak,
            "run_peak": _status("VmHWM:") - before,
            "load_seconds": load_seconds,
            "tokens_per_second": new_tokens / seconds,
            "tokens": tokens[0, PROMPT:].tolist(),
        }
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--worker", choices=VARIANTS)
    parser.add_argument("--checkpoint")
    parser.add_argument("--new_tokens", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    if args.quick:
        args.new_tokens, args.rounds = 4, 1
    if args.worker:
        worker(args.worker, args.checkpoint, args.quick, args.new_tokens)
        return
    try:
        from transformers import LlamaForCausalLM
    except ImportError:
        raise SystemExit("big_model.py needs transformers: pip install transformers") from None
    folder = tempfile.mkdtemp(prefix="slipstream-big-model-")
    try:
        torch.manual_seed(0)
        LlamaForCausalLM(_config(args.quick)).save_pretrained(
            f"{folder}/llama", max_shard_size="50MB" if not args.quick else "500KB"
        )
        results: dict[str, list[dict[str, Any]]] = {v: [] for v in VARIANTS}
        for round_index in range(args.rounds):
            order = VARIANTS if round_index % 2 == 0 else VARIANTS[::-1]
            for variant in order:
                arguments = ["--worker", variant, "--checkpoint", f"{folder}/llama",
                             "--new_tokens", str(args.new_tokens), *(["--quick"] if args.quick else [])]  # fmt: skip
                # glibc keeps freed large blocks unless they are mmap'ed: without this the
                # peak would measure the allocator's retention rather than live tensors.
                env = {"MALLOC_MMAP_THRESHOLD_": "131072"}
                results[variant] += workers.run_workers(__file__, arguments, processes=1, env=env)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    _print(results)


def _print(results: dict[str, list[dict[str, Any]]]) -> None:
    mib = 2**20
    off, full = results["offloaded"], results["in_memory"]
    first = off[0]
    same = all(r["tokens"] == first["tokens"] for r in off + full)
    peak = max(max(r["load_peak"], r["run_peak"]) for r in off)
    target = first["budget"] + first["largest"]
    print(
        f"model {first['model'] / mib:.0f} MiB, CPU budget {first['budget'] / mib:.0f} MiB "
        f"(model / budget {first['model'] / first['budget']:.1f}x), largest block "
        f"{first['largest'] / mib:.0f} MiB; weights held in memory when offloaded "
        f"{first['resident'] / mib:.0f} MiB; generated tokens {'equal' if same else 'DIFFERENT'}"
    )
    for name, runs in (("offloaded", off), ("in memory", full)):
        print(
            f"{name:9s}: peak resident memory above the process: loading "
            f"{max(r['load_peak'] for r in runs) / mib:.0f} MiB, generating "
            f"{max(r['run_peak'] for r in runs) / mib:.0f} MiB; load "
            f"{statistics.median(r['load_seconds'] for r in runs):.2f} s; "
            f"{statistics.median(r['tokens_per_second'] for r in runs):.2f} tokens/s"
        )
    print(
        f"offloaded peak resident memory vs budget + largest block "
        f"({target / mib:.0f} MiB): ratio {peak / target:.2f}x"
    )
    in_memory_peak = max(max(r["load_peak"], r["run_peak"]) for r in full)
    print(f"offloaded vs in-memory peak resident memory: ratio {peak / in_memory_peak:.2f}x")
    # Paired by round (the two variants ran back to back), which cancels most of a shared
    # machine's drift between rounds.
    speed = statistics.median(
        a["tokens_per_second"] / b["tokens_per_second"] for a, b in zip(off, full, strict=True)
    )
    print(f"offloaded vs in-memory generation speed (tokens/s): ratio {speed:.2f}x")


if __name__ == "__main__":
    main()
