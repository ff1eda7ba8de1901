"""Networks no one here wrote (or written the way their authors write them), for the
any-model tests: each a factory returning ``(model, example_inputs, split_points)``."""

from __future__ import annotations

import torch
import torchvision
from lightning.pytorch.demos import Transformer
from torch import nn
from torch.nn import functional as F

from lightning_par.models import CifarCNN, CifarRNN


class TinyGPT(nn.Module):
    """A GPT-style decoder whose output layer is the token embedding (tied weights), as in
    GPT-2 and nanoGPT: ``lm_head.weight is wte.weight``."""

    def __init__(self, vocab: int = 50, width: int = 32, layers: int = 3, heads: int = 2):
        super().__init__()
        self.wte = nn.Embedding(vocab, width)
        self.wpe = nn.Embedding(16, width)
        self.blocks = nn.ModuleList(
            nn.TransformerEncoderLayer(width, heads, 2 * width, dropout=0.0, batch_first=True)
            for _ in range(layers)
        )
        self.ln_f = nn.LayerNorm(width)
        self.lm_head = nn.Linear(width, vocab, bias=False)
        self.lm_head.weight = self.wte.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        b, t = tokens.shape
        positions = torch.arange(t, device=tokens.device)
        x = self.wte(tokens) + self.wpe(positions)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class RawParameters(nn.Module):
    """Raw parameters used through ``torch.mm`` and a buffer read on both sides of a cut
    (the shape of torch's pipelining test model ``ExampleCode``, written anew)."""

    def __init__(self, d: int = 16):
        super().__init__()
        self.mm_param = nn.Parameter(torch.randn(d, d))
        self.mm_param2 = nn.Parameter(torch.randn(d, d))
        self.register_buffer("scale", torch.full((d,), 0.5))
        self.lin0 = nn.Linear(d, d)
        self.lin1 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.mm_param) * self.scale
        skip = F.relu(x)
        x = self.lin0(skip)
        x = torch.mm(x, self.mm_param2)
        return self.lin1(x) * self.scale + skip  # the skip crosses both cuts


def resnet18_group_norm():
    model = torchvision.models.resnet18(num_classes=10, norm_layer=lambda c: nn.GroupNorm(4, c))
    return model, (torch.randn(4, 3, 32, 32),), ["layer2", "layer4"]


def resnet18_batch_norm():
    model = torchvision.models.resnet18(num_classes=10)
    return model, (torch.randn(4, 3, 32, 32),), ["layer1.1", "layer3"]


def demo_transformer():
    model = Transformer(vocab_size=60, ninp=32, nhead=2, nhid=32, nlayers=2, dropout=0.0)
    tokens = torch.randint(0, 60, (3, 8))
    return model, (tokens, torch.randint(0, 60, (3, 8))), ["transformer", "decoder"]


def tiny_gpt():
    return TinyGPT(), (torch.randint(0, 50, (3, 12)),), ["blocks.1", "ln_f"]


def cifar_cnn():
    return CifarCNN().net, (torch.randn(4, 3, 32, 32),), ["2", "4"]


def cifar_rnn():
    return CifarRNN().net, (torch.randn(4, 3, 32, 32),), ["2", "3"]


def raw_parameters():
    return RawParameters(), (torch.randn(5, 16),), ["lin0", "lin1"]


def mobilenet_v2():
    model = torchvision.models.mobilenet_v2(num_classes=10, width_mult=0.25)
    return model, (torch.randn(2, 3, 32, 32),), ["features.6", "features.12"]


MODELS = {
    "resnet18_group_norm": resnet18_group_norm,
    "resnet18_batch_norm": resnet18_batch_norm,
    "demo_transformer": demo_transformer,
    "tiny_gpt": tiny_gpt,
    "cifar_cnn": cifar_cnn,
    "cifar_rnn": cifar_rnn,
    "raw_parameters": raw_parameters,
    "mobilenet_v2": mobilenet_v2,
}
