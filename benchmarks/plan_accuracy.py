"""How well ``slipstream plan`` predicts: peak memory and step time of layouts, predicted
against measured, for a small transformers Llama and a small Qwen3-MoE on 4 CPU processes.

Each layout is run by slipstream for a few AdamW steps (``slipstream.planning.verify``, the
code behind ``slipstream plan --verify``): global batch 8 x 128 tokens, fp32.

* **Memory**: each process's resident high-water mark during training above its resident
  size just before the model was built (after one warm-up step of a one-layer copy, so the
  libraries' first-use allocations are not counted), the largest process of the layout;
  predicted by the planner's model of the same thing, before any calibration. Target: within
  15% for every layout.
* **Time**: the median step (after the first) of the slowest process. Predicted first with
  the CPU preset's round figures, then after fitting the time model's four constants to
  these measurements (what ``--verify`` saves for later plans). Target: the layout predicted
  fastest after calibration is measured within 10% of the fastest measured.

Layouts (4 processes): DDP 4, FSDP 4, HSDP 2x2, tp2 x dp_shard2, pp2 (1F1B) x dp_shard2,
pp2 x tp2, ZeRO-3 4, and FSDP 4 with full recomputation (Llama) or dp_shard4 with experts
over ep2 (MoE). Run:

    python benchmarks/plan_accuracy.py           # 16 layouts, ~15 minutes on 2 cores
    python benchmarks/plan_accuracy.py --quick   # one layout on one process (smoke test)

``--quick`` predicts and measures one tiny Llama on one process, started through
``workers.run_workers`` (the suite forks it from a warm worker): the planner's prediction
and the verify worker's measurement, without the launcher, the 16 layouts or calibration.
"""

from __future__ import annotations

import argparse
import dataclasses
import time

from slipstream.planning.layouts import Layout
from slipstream.planning.model_source import ModelSource
from slipstream.planning.verify import calibrate, check_layouts, cpu_cluster, fastest_agreement

LLAMA = {
    "model_type": "llama", "vocab_size": 8192, "hidden_size": 512, "intermediate_size": 1536,
    "num_hidden_layers": 4, "num_attention_heads": 8, "num_key_value_heads": 8,
    "tie_word_embeddings": False,
}  # fmt: skip
MOE = {
    "model_type": "qwen3_moe", "vocab_size": 8192, "hidden_size": 256,
    "intermediate_size": 768, "moe_intermediate_size": 384, "num_hidden_layers": 4,
    "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 32, "num_experts": 8,
    "num_experts_per_tok": 2, "tie_word_embeddings": False,
}  # fmt: skip
QUICK = {**LLAMA, "vocab_size": 2048, "hidden_size": 256, "intermediate_size": 512,
         "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 4}  # fmt: skip
BATCH, SEQUENCE = 8, 128


def layouts(moe: bool) -> dict[str, Layout]:
    """The layouts of the issue, for a global batch of BATCH on 4 processes."""
    chosen = {
        "ddp4": Layout(dp_replicate=4, engine="ddp", micro_batch=2),
        "fsdp4": Layout(dp_shard=4, micro_batch=2),
        "hsdp2x2": Layout(dp_replicate=2, dp_shard=2, micro_batch=2),
        "tp2xdp2": Layout(dp_shard=2, tp=2, micro_batch=4),
        "pp2xdp2": Layout(dp_shard=2, pp=2, micro_batch=2, pp_microbatches=2),
        "pp2xtp2": Layout(tp=2, pp=2, micro_batch=2, pp_microbatches=4),
        "zero3": Layout(dp_shard=4, engine="zero3", micro_batch=2),
    }
    if moe:
        chosen["ep2xdp_shard4"] = Layout(dp_shard=4, ep=2, micro_batch=2)
    else:
        chosen["fsdp4_recompute"] = Layout(dp_shard=4, micro_batch=2, recompute="full")
    return {
        name: dataclasses.replace(layout, mixed_precision="no") for name, layout in chosen.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="one tiny layout on one process (smoke test)"
    )
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.quick and args.worker:
        _quick()
        return
    if args.quick:
        import workers  # benchmarks/workers.py, beside this script

        [report] = workers.run_workers(__file__, ["--quick", "--worker"], processes=1)
        print(
            f"quick  1 process  memory predicted {report['predicted_mib']:.1f} MiB measured "
            f"{report['peak_mib']:.1f} MiB ratio {report['predicted_mib'] / report['peak_mib']:.3f}x; "
            f"step measured {report['step_seconds']:.3f} s"
        )
        return
    cases = {
        "llama": (ModelSource("tiny-llama", "config", LLAMA), layouts(moe=False)),
        "moe": (ModelSource("tiny-qwen3-moe", "config", MOE), layouts(moe=True)),
    }
    _measure(cases, steps=args.steps)


def _quick() -> None:
    """The one process of ``--quick`` (no launcher: workers.py set its rank's variables)."""
    import contextlib
    import ctypes

    import workers

    from slipstream.planning.candidates import evaluate
    from slipstream.planning.profile import profile_model
    from slipstream.planning.verify_worker import run

    # As MALLOC_MMAP_THRESHOLD_ does for the checked processes: freed blocks leave.
    with contextlib.suppress(OSError):
        ctypes.CDLL("libc.so.6").mallopt(-3, 131072)  # M_MMAP_THRESHOLD
    source = ModelSource("tiny-llama", "config", QUICK)
    layout = Layout(dp_shard=1, micro_batch=2, mixed_precision="no")
    profile = profile_model(source, SEQUENCE, compute_bytes=4)
    predicted = evaluate(profile, layout, cpu_cluster(1, calibrated=False)).memory.peak / 2**20
    spec = {"model": source.as_dict(), "layout": layout.as_dict(), "layers": source.layers,
            "seq_len": SEQUENCE, "steps": 2}  # fmt: skip
    [report] = run(spec) or []
    workers.report(
        {"predicted_mib": predicted, "peak_mib": report["peak_mib"],
         "step_seconds": report["step_seconds"]}
    )  # fmt: skip


def _measure(cases: dict[str, tuple[ModelSource, dict[str, Layout]]], steps: int) -> None:
    started = time.perf_counter()
    checks = {}
    for model, (source, chosen) in cases.items():
        checks[model] = check_layouts(source, list(chosen.values()), seq_len=SEQUENCE,
                                      layers=source.layers, steps=steps, calibrated=False)  # fmt: skip
    everything = [check for found in checks.values() for check in found]
    fitted, constants = calibrate(everything, cpu_cluster(4, calibrated=False), save=False)
    position = 0
    for model, (_, chosen) in cases.items():
        count = len(chosen)
        checks[model] = fitted[position : position + count]
        position += count
    print(f"{BATCH} x {SEQUENCE} tokens per step, fp32, AdamW, CPU processes; "
          f"fitted: {1 / constants.seconds_per_flop / 1e9:.2f} GFLOP/s per process, "
          f"bandwidth x{1 / constants.bandwidth_scale if constants.bandwidth_scale else float('inf'):.2f}, "
          f"{constants.latency * 1e3:.2f} ms per collective, "
          f"{1 / constants.seconds_per_byte_moved / 1e9 if constants.seconds_per_byte_moved else float('inf'):.2f} GB/s "
          "optimizer")  # fmt: skip
    for model, (_, chosen) in cases.items():
        for name, check in zip(chosen, checks[model], strict=True):
            print(
                f"{model:6s} {name:16s} memory predicted {check.predicted_mib:7.1f} MiB measured "
                f"{check.measured_mib:7.1f} MiB ratio {check.memory_ratio:.3f}x; step predicted "
                f"{check.predicted_seconds:6.3f} s, calibrated {check.calibrated_seconds:6.3f} s, "
                f"measured {check.measured_seconds:6.3f} s"
            )
        worst = max(max(c.memory_ratio, 1 / c.memory_ratio) for c in checks[model])
        print(
            f"{model} largest memory error over {len(chosen)} layouts (1 = exact): ratio {worst:.3f}x"
        )
        predicted, measured, slower = fastest_agreement(checks[model])
        names = {id(c): n for n, c in zip(chosen, checks[model], strict=True)}
        print(
            f"{model} predicted fastest after calibration {names[id(predicted)]} measured "
            f"{predicted.measured_seconds:.3f} s vs fastest measured {names[id(measured)]} "
            f"{measured.measured_seconds:.3f} s: ratio {slower:.3f}x"
        )
    print(f"took {time.perf_counter() - started:.0f} s")


if __name__ == "__main__":
    main()
