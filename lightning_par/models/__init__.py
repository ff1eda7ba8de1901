"""Example models: every plugin trains these on CIFAR-10."""

from lightning_par.models.classifier import ImageClassifier
from lightning_par.models.cnn import CifarCNN, ResidualBlock, build_cnn
from lightning_par.models.resnet import ResNet18
from lightning_par.models.rnn import CifarRNN, ImageToRows, LSTMLayer, build_rnn
from lightning_par.models.tiny import TinyCNN, build_tiny_cnn

__all__ = [
    "CifarCNN",
    "CifarRNN",
    "ImageClassifier",
    "ImageToRows",
    "LSTMLayer",
    "ResNet18",
    "ResidualBlock",
    "TinyCNN",
    "build_cnn",
    "build_rnn",
    "build_tiny_cnn",
]
