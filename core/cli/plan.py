"""``slipstream plan MODEL``: which layout fits a model, a batch and a cluster, and trains
fastest.

MODEL is a transformers config (a Hub name, a folder with config.json, or the file), or
``module:callable`` returning an ``nn.Module`` (built on the meta device: no weights).

The plan enumerates layouts (dp_replicate x dp_shard x tp x pp x ep x cp; DDP, FSDP2/HSDP
or ZeRO-1/2/3; pipeline schedule and micro-batches; full activation recomputation;
offload when nothing fits without it), predicts each one's peak memory per device
(parameters, gradients, optimizer states, activations traced from the model, gathered
weights and communication buffers) and its step time (FLOPs at a stated efficiency, each
collective's bytes over the links it crosses, the pipeline's bubble, exposed and hidden
communication, the optimizer's update), drops what does not fit and prints the rest,
fastest first, with where each figure comes from. When nothing fits it says what would.

Devices: --device H100, H200, A100, MI300, "TPU v5e" or CPU (presets; --device_memory,
--intra_bw, --inter_bw and --device_tflops override them). Memory sizes in binary units
(80GB = 80 GiB), bandwidths in decimal ones (900GB/s; 400Gb/s in bits).

--write config.yaml writes the fastest layout as a `slipstream launch` config.
--verify N runs the N fastest layouts for a few steps as CPU processes of this machine (the
same layout shape, fewer layers, fp32), prints predicted against measured memory and step
time, and fits the time model to this machine (kept in ~/.cache/slipstream for later plans
with --device CPU).

Example:
    slipstream plan meta-llama/Llama-3.1-8B --nodes 1 --devices_per_node 8 --device H100 \\
        --global_batch 16 --seq_len 8192 --write config.yaml
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .text import description


def _add(parser: argparse.ArgumentParser, name: str, **kwargs: Any) -> None:
    parser.add_argument(f"--{name}", f"--{name.replace('_', '-')}", **kwargs)


def register(subparsers: Any) -> None:
    summary = "choose the layout for a model, a batch and a cluster"
    parser = subparsers.add_parser(
        "plan",
        help=summary,
        description=description(__doc__),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.set_defaults(run=run)
    parser.add_argument("model", help="transformers config name/path, config.json, or module:fn")
    _add(parser, "nodes", type=int, default=1, help="machines (default 1)")
    _add(parser, "devices_per_node", type=int, default=8, help="devices per machine (default 8)")
    _add(parser, "device", default="H100", help="device preset (default H100)")
    _add(parser, "device_memory", help="memory per device, e.g. 80GB (default: the preset's)")
    _add(parser, "intra_bw", help="bandwidth between devices of a node, e.g. 450GB/s")
    _add(parser, "inter_bw", help="bandwidth per device between nodes, e.g. 400Gb/s")
    _add(parser, "device_tflops", help="dense TFLOP/s per device in the training precision")
    _add(parser, "global_batch", type=int, required=True, help="samples per optimizer step")
    _add(parser, "seq_len", type=int, required=True, help="tokens per sample")
    _add(parser, "mixed_precision", choices=("no", "bf16", "fp16"),
         help="default: bf16 on accelerators, no (fp32) on CPU")  # fmt: skip
    _add(parser, "top", type=int, default=10, help="layouts shown (default 10)")
    _add(parser, "write", metavar="FILE", help="write the fastest layout as a launch config")
    _add(parser, "verify", type=int, nargs="?", const=3, default=0, metavar="N",
         help="run the N fastest layouts on this machine's CPU (default 3) and calibrate")  # fmt: skip
    _add(parser, "verify_layers", type=int, help="decoder layers of the checked copy")
    _add(parser, "verify_steps", type=int, default=3, help="steps per checked layout")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def run(args: argparse.Namespace) -> int:
    from ..options.errors import ConfigError
    from ..planning.planner import plan
    from ..planning.report import plan_as_dict

    for flag in ("nodes", "devices_per_node", "top", "verify_steps"):
        if getattr(args, flag) < 1:
            raise ConfigError(f"--{flag} must be at least 1, got {getattr(args, flag)}")
    result = plan(
        args.model,
        nodes=args.nodes,
        devices_per_node=args.devices_per_node,
        device=args.device,
        device_memory=args.device_memory,
        intra_bw=args.intra_bw,
        inter_bw=args.inter_bw,
        device_tflops=args.device_tflops,
        global_batch=args.global_batch,
        seq_len=args.seq_len,
        mixed_precision=args.mixed_precision,
    )
    if args.json:
        print(json.dumps(plan_as_dict(result, args.top), indent=2))
    else:
        print(result.table(args.top))
    if args.write:
        if result.best is None:
            raise ConfigError("nothing fits, so no config was written (see what would fit above)")
        from ..planning.launch_file import write_launch_config

        path = write_launch_config(result.best, result.cluster, args.write)
        print(f"\nwrote {path}: slipstream launch --config_file {path} your_script.py")
    if args.verify:
        _verify(result, args)
    return 0


def _verify(result: Any, args: argparse.Namespace) -> None:
    from ..options.errors import ConfigError
    from ..planning.verify import (
        calibrate,
        check_layouts,
        cpu_cluster,
        fastest_agreement,
        format_checks,
        scaled_layers,
    )

    chosen = [c.layout for c in list(result)[: args.verify]]
    if not chosen:
        raise ConfigError("--verify: nothing fits, so there is no layout to check")
    source = result.profile.source
    layers = scaled_layers(source, chosen, args.verify_layers)
    print(f"\nChecking {len(chosen)} layout(s) on this machine's CPU (fp32, "
          f"{layers if layers is not None else 'all'} layers, {args.seq_len} tokens):")  # fmt: skip
    checks = check_layouts(source, chosen, seq_len=args.seq_len, layers=layers,
                           steps=args.verify_steps, progress=print)  # fmt: skip
    print(format_checks(checks))
    checks, _ = calibrate(checks, cpu_cluster(chosen[0].world_size, calibrated=False))
    print("\nAfter calibration (saved for later plans on CPU):")
    print(format_checks(checks))
    predicted, measured, slower = fastest_agreement(checks)
    print(
        f"predicted fastest: {predicted.layout.describe()}; measured fastest: "
        f"{measured.layout.describe()} (the predicted one takes {slower:.3f}x its time)"
    )
