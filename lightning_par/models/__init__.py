"""Example models: every plugin trains these on CIFAR-10."""

from lightning_par.models.classifier import ImageClassifier
from lightning_par.models.cnn import CifarCNN, ResidualBlock, build_cnn
from lightning_par.models.rnn import CifarRNN, ImageToRows, LSTMLayer, build_rnn

__all__ = [
    "CifarCNN",
    "CifarRNN",
    "ImageClassifier",
    "ImageToRows",
    "LSTMLayer",
    "ResidualBlock",
    "build_cnn",
    "build_rnn",
]
