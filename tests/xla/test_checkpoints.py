"""save_state / load_state resume exactly on the XLA device; what is written holds CPU
tensors (readable without torch_xla)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file

from .helpers import fresh_accelerator, model_and_data, train, weights


def _accelerator_and_parts(folder: Path) -> tuple[Any, tuple[Any, ...]]:
    accelerator = fresh_accelerator(project_dir=str(folder), gradient_accumulation_steps=2)
    parts = accelerator.prepare(*model_and_data(dropout=0.2))  # dropout: the XLA RNG too
    return accelerator, parts


def _losses_after(
    accelerator: Any, parts: tuple[Any, ...], save_at: int | None, folder: Path
) -> list[float]:
    """Train one epoch; save after batch ``save_at``; the losses of the batches after it."""
    model, optimizer, loader, scheduler = parts
    losses = []
    for index, (inputs, targets) in enumerate(loader):
        with accelerator.accumulate(model):
            loss = torch.nn.functional.mse_loss(model(inputs), targets)
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                accelerator.clip_grad_norm_(model.parameters(), 0.5)
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
        losses.append(float(loss.detach().cpu()))
        if index == save_at:
            accelerator.save_state(str(folder))
            losses = []
    return losses


def test_resume_from_save_state_is_exact(tmp_path: Path) -> None:
    accelerator, parts = _accelerator_and_parts(tmp_path)
    # After 6 of 12 batches: 3 optimizer steps of 2 micro-batches, mid-epoch.
    rest = _losses_after(accelerator, parts, 5, tmp_path / "ckpt")
    expected = weights(accelerator, parts[0])
    assert len(rest) == 6

    resumed, again = _accelerator_and_parts(tmp_path)
    resumed.load_state(str(tmp_path / "ckpt"))
    rest_again = _losses_after(resumed, again, None, tmp_path / "unused")
    assert rest_again == rest
    got = weights(resumed, again[0])
    assert all(torch.equal(expected[k], got[k]) for k in expected)

    written = load_file(str(tmp_path / "ckpt" / "model.safetensors"))
    assert all(t.device.type == "cpu" for t in written.values())
    optimizer_state = torch.load(tmp_path / "ckpt" / "optimizer.bin", weights_only=True)
    moments = [v for s in optimizer_state["state"].values() for v in s.values()]
    assert moments and all(t.device.type == "cpu" for t in moments if torch.is_tensor(t))
    rng = torch.load(tmp_path / "ckpt" / "random_states_0.pkl", weights_only=True)
    assert isinstance(rng["xla"], int)  # the XLA generator (dropout) is restored too


def test_save_model_writes_cpu_weights(tmp_path: Path) -> None:
    accelerator = fresh_accelerator()
    model, optimizer, loader, scheduler = accelerator.prepare(*model_and_data())
    train(accelerator, (model, optimizer, loader, scheduler), batches=2)
    accelerator.save_model(model, str(tmp_path / "out"))
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    current = weights(accelerator, model)
    assert written.keys() == current.keys()
    assert all(torch.equal(written[k], current[k]) for k in current)
    accelerator.save({"w": model[0].weight}, str(tmp_path / "plain.pt"))
    saved = torch.load(tmp_path / "plain.pt", weights_only=True)
    assert saved["w"].device.type == "cpu"
