"""Big-model inference: a model three times larger than its memory budget, run with most of
its weights left on disk, and the prompts split across processes.

    python examples/big_model_inference.py
    slipstream launch --num_processes 2 --cpu examples/big_model_inference.py

The first run saves a random transformers Llama in shards (``save_pretrained``, the main
process only, while the others wait). Every process then builds the model without memory
(``init_empty_weights``), plans where its parts go under a CPU budget of a third of its size
(``infer_auto_device_map``), loads it tensor by tensor — what does not fit stays in the
checkpoint's own files and is read layer by layer at each forward — and greedily generates
for its share of the prompts. The main process prints every answer, in prompt order.

Options: --quick (a tiny model), --checkpoint DIR (where the model is saved; default: the
temporary folder), --budget F (CPU budget as a fraction of the model, default 0.33),
--new_tokens N, --check (also run the whole model in memory and compare the answers).
Needs ``pip install transformers``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
import time

import torch

from slipstream import (
    PartialState,
    gather_object,
    infer_auto_device_map,
    init_empty_weights,
    load_checkpoint_and_dispatch,
)
from slipstream.utils import compute_module_sizes

PROMPTS = [
    "The capital of France is",
    "Once upon a time",
    "def fibonacci(n):",
    "The quick brown fox",
    "In 1492,",
]


def build_config(quick: bool):  # -> transformers.LlamaConfig
    from transformers import LlamaConfig

    width, layers, vocab = (64, 6, 256) if quick else (512, 8, 1024)
    return LlamaConfig(
        vocab_size=vocab, hidden_size=width, intermediate_size=width * 3, num_hidden_layers=layers,
        num_attention_heads=8, num_key_value_heads=4, tie_word_embeddings=False,
    )  # fmt: skip


def save_random_model(folder: str, quick: bool) -> None:
    """A random Llama in several safetensors shards, written atomically (rename at the end)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(build_config(quick))
    staging = f"{folder}.partial-{os.getpid()}"
    model.save_pretrained(staging, max_shard_size="200KB" if quick else "20MB")
    if os.path.isdir(folder):
        shutil.rmtree(folder)
    os.replace(staging, folder)


def encode(prompt: str, vocab: int) -> torch.Tensor:
    """Stand-in for a tokenizer (the model is random anyway): one token per byte."""
    return torch.tensor([[byte % vocab for byte in prompt.encode()]])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--checkpoint", default=None)
    parser.add_argument("--budget", type=float, default=0.33)
    parser.add_argument("--new_tokens", type=int, default=8)
    parser.add_argument("--check", action="store_true")
    args = parser.parse_args()
    from transformers import LlamaForCausalLM

    state = PartialState()
    size = "tiny" if args.quick else "small"
    checkpoint = args.checkpoint or os.path.join(tempfile.gettempdir(), f"slipstream-llama-{size}")
    with state.main_process_first():  # the main process writes it, the others then read it
        if state.is_main_process and not os.path.isfile(os.path.join(checkpoint, "config.json")):
            save_random_model(checkpoint, args.quick)

    config = build_config(args.quick)
    with init_empty_weights():
        model = LlamaForCausalLM(config)  # no memory yet: every weight is on the meta device
    sizes = compute_module_sizes(model)
    budget = {"cpu": int(sizes[""] * args.budget)}
    device_map = infer_auto_device_map(model, max_memory=budget)  # LlamaDecoderLayer kept whole
    started = time.perf_counter()
    model = load_checkpoint_and_dispatch(
        model, checkpoint, device_map=device_map,
        offload_folder=f"{checkpoint}-offload-{state.process_index}",  # one per process
    )  # fmt: skip
    loaded = time.perf_counter() - started
    in_memory = sum(sizes[name] for name, device in device_map.items() if device == "cpu")
    state.print(
        f"model {sizes[''] / 2**20:.2f} MiB, CPU budget {budget['cpu'] / 2**20:.2f} MiB: "
        f"{in_memory / 2**20:.2f} MiB in memory, the rest on disk; loaded in {loaded:.2f} s"
    )

    answers = []
    with state.split_between_processes(list(enumerate(PROMPTS))) as mine, torch.no_grad():
        for index, prompt in mine:
            tokens = encode(prompt, config.vocab_size)
            output = model.generate(
                tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0,
            )  # fmt: skip
            answers.append((index, prompt, output[0, tokens.shape[1] :].tolist()))
    everything = gather_object(answers)  # every process's answers, in process order

    if args.check and state.is_main_process:
        whole = LlamaForCausalLM.from_pretrained(checkpoint).eval()
        for _, prompt, generated in everything:
            tokens = encode(prompt, config.vocab_size)
            expected = whole.generate(
                tokens, attention_mask=torch.ones_like(tokens), max_new_tokens=args.new_tokens,
                do_sample=False, pad_token_id=0,
            )[0, tokens.shape[1] :].tolist()  # fmt: skip
            assert generated == expected, f"{prompt!r}: {generated} != {expected}"
        print("answers equal the in-memory model's")
    for index, prompt, generated in everything:
        state.print(f"{index}: {prompt!r} -> {generated}")
    state.print(f"{len(everything)} answers from {state.num_processes} processes")


if __name__ == "__main__":
    main()
