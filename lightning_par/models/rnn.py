"""A stacked-LSTM classifier that reads each CIFAR image as 32 rows of 96 values.

Each LSTM layer is its own element of ``self.net``, so a layer-wise strategy can put
layer k on device k: the "wavefront" of the course slides (003), where layer k works on
row t while layer k+1 works on row t-1.
"""

from __future__ import annotations

import torch
from torch import nn

from lightning_par.models.classifier import ImageClassifier


class ImageToRows(nn.Module):
    """``[B, 3, 32, 32]`` images to ``[B, 32, 96]`` sequences: one step per pixel row."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, c, h, w = x.shape
        return x.permute(0, 2, 1, 3).reshape(b, h, c * w)


class LSTMLayer(nn.Module):
    """One LSTM layer over a whole sequence, returning only its outputs ``[B, T, H]``."""

    def __init__(self, input_size: int, hidden_size: int) -> None:
        super().__init__()
        self.lstm = nn.LSTM(input_size, hidden_size, batch_first=True)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lstm(x)[0]

    def forward_chunk(self, x: torch.Tensor, state):
        """Run on a time chunk from ``state`` ((h, c) or None); returns (outputs, (h, c)), so
        the layerwise wavefront can carry the state to the next chunk."""
        return self.lstm(x, state)


class LastStep(nn.Module):
    """Classify from the last time step's output."""

    def __init__(self, hidden_size: int, num_classes: int) -> None:
        super().__init__()
        self.fc = nn.Linear(hidden_size, num_classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(x[:, -1])


def build_rnn(hidden_size: int = 128, num_layers: int = 2, num_classes: int = 10):
    if hidden_size < 1 or num_layers < 1:
        raise ValueError(
            f"hidden_size and num_layers must be >= 1, got {hidden_size} and {num_layers}"
        )
    layers: list[nn.Module] = [ImageToRows()]
    in_size = 3 * 32
    for _ in range(num_layers):
        layers.append(LSTMLayer(in_size, hidden_size))
        in_size = hidden_size
    layers.append(LastStep(hidden_size, num_classes))
    return nn.Sequential(*layers)


class CifarRNN(ImageClassifier):
    """Stacked LSTM over image rows.

    Args:
        hidden_size: LSTM hidden units per layer.
        num_layers: stacked LSTM layers (each a separate, splittable element of ``net``).
        **kwargs: optimiser settings of :class:`ImageClassifier` (Adam by default: LSTMs
            train more reliably with it than with plain SGD at a short budget).
    """

    def __init__(
        self,
        hidden_size: int = 128,
        num_layers: int = 2,
        num_classes: int = 10,
        optimizer: str = "adam",
        lr: float = 2e-3,
        momentum: float = 0.9,
        weight_decay: float = 0.0,
        scheduler: str | None = "onecycle",
    ) -> None:
        super().__init__(num_classes, optimizer, lr, momentum, weight_decay, scheduler)
        self.save_hyperparameters()
        self.net = build_rnn(hidden_size, num_layers, num_classes)
