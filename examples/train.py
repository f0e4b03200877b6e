"""Train a small classifier on a synthetic task with slipstream.

The training loop is plain PyTorch plus four slipstream lines. Run it on one process, on
several CPU processes, or on GPUs, unchanged:

    python examples/train.py
    slipstream launch --num_processes 2 --cpu examples/train.py
    torchrun --nproc_per_node 2 examples/train.py

It prints the held-out loss and accuracy before training (an untrained model guesses) and
after every epoch.

Options: --epochs N, --batch_size N, --lr X, --quick (two short epochs, for tests),
--save PATH (write the final weights from the main process), --plot loss.png (a chart of
the training loss, needs matplotlib).
"""

from __future__ import annotations

import argparse
import importlib.util

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from slipstream import Accelerator, set_seed

if importlib.util.find_spec("tqdm") is not None:  # the progress bar is optional
    # slipstream's: drawn by each machine's main process; in a log, a line every 30 s.
    from slipstream.utils import tqdm
else:

    def tqdm(iterable, **_):  # type: ignore[no-redef]
        return iterable


def make_dataset(samples: int, generator: torch.Generator) -> TensorDataset:
    """Points in 16 dimensions, labelled by which of 4 random directions they lean to."""
    directions = torch.randn(4, 16, generator=torch.Generator().manual_seed(0))
    inputs = torch.randn(samples, 16, generator=generator)
    targets = (inputs @ directions.T).argmax(dim=1)
    return TensorDataset(inputs, targets)


def evaluate(
    accelerator: Accelerator, model: nn.Module, loader: DataLoader
) -> tuple[float, float, int]:
    """Held-out loss and accuracy, every sample counted once over all processes."""
    model.eval()
    loss_sum, correct, seen = 0.0, 0, 0
    with torch.no_grad():
        for inputs, targets in loader:
            outputs = model(inputs)
            losses = F.cross_entropy(outputs, targets, reduction="none")
            # gather_for_metrics drops the samples sharding repeated to even out the shards.
            losses, predictions, targets = accelerator.gather_for_metrics(
                (losses, outputs.argmax(dim=1), targets)
            )
            loss_sum += float(losses.sum())
            correct += int((predictions == targets).sum())
            seen += len(targets)
    model.train()
    return loss_sum / seen, correct / seen, seen


def plot_losses(losses: list[float], path: str, processes: int) -> None:
    """Save a chart of the per-step training loss (main process's batches)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(6, 3.5))
    axes.plot(range(1, len(losses) + 1), losses, linewidth=1)
    axes.set(
        xlabel="optimizer step",
        ylabel="training loss",
        yscale="log",
        title=f"examples/train.py on {processes} process(es)",
    )
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    print(f"loss chart written to {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--quick", action="store_true", help="two short epochs (tests)")
    parser.add_argument("--save", default=None, help="write the final weights here")
    parser.add_argument("--plot", default=None, help="write a PNG chart of the loss here")
    args = parser.parse_args()

    accelerator = Accelerator()
    set_seed(1234)
    samples = 2048 if args.quick else 8000
    epochs = 2 if args.quick else args.epochs
    train_set = make_dataset(samples, torch.Generator().manual_seed(1))
    eval_set = make_dataset(1001, torch.Generator().manual_seed(2))

    model = nn.Sequential(nn.Linear(16, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    training_dataloader = DataLoader(train_set, batch_size=args.batch_size, shuffle=True)
    eval_dataloader = DataLoader(eval_set, batch_size=args.batch_size)
    total_steps = epochs * len(training_dataloader)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: max(0.0, 1.0 - step / total_steps)
    )
    loss_function = nn.CrossEntropyLoss()

    model, optimizer, training_dataloader, eval_dataloader, scheduler = accelerator.prepare(
        model, optimizer, training_dataloader, eval_dataloader, scheduler
    )

    processes = accelerator.num_processes

    def report(when: str) -> None:
        loss, accuracy, seen = evaluate(accelerator, model, eval_dataloader)
        accelerator.print(
            f"{when}: held-out loss {loss:.4f}, accuracy {accuracy:.3f} on {seen} samples "
            f"({processes} process{'es' if processes > 1 else ''}, {accelerator.device})"
        )

    report("before training")  # chance level: loss about ln 4 = 1.386, accuracy about 0.25
    losses: list[float] = []
    for epoch in range(epochs):
        model.train()
        progress = tqdm(training_dataloader, desc=f"epoch {epoch}")
        for batch in progress:
            optimizer.zero_grad()
            inputs, targets = batch
            outputs = model(inputs)
            loss = loss_function(outputs, targets)
            accelerator.backward(loss)
            optimizer.step()
            scheduler.step()
            losses.append(loss.item())
        report(f"epoch {epoch}")

    if args.plot and accelerator.is_main_process:
        plot_losses(losses, args.plot, accelerator.num_processes)
    if args.save:
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            torch.save(accelerator.unwrap_model(model).state_dict(), args.save)
    accelerator.end_training()


if __name__ == "__main__":
    main()
